"""What the vLLM parity tests (EAGLE-3 / EAGLE-3.1, P-EAGLE, DFlash and DSpark run through vLLM's
own modules) share: the verifier's geometry, vLLM's single-process distributed state, a stand-in
attention kernel, the names vLLM's DFlash / DSpark loaders give the exported tensors and, for
EAGLE-3 / EAGLE-3.1, a random draft exported with ``eval/export.py``, vLLM's
``Eagle3LlamaForCausalLM`` built from that export and both run on the same first TTT step."""

from __future__ import annotations

import socket
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F

from helpers.tiny import build_tokenizer, write_draft_checkpoint

# the verifier's geometry: hidden, heads, kv heads, head dim, intermediate, vocab, draft vocab
H, NH, NKV, HD, I, V, VD = 64, 4, 2, 16, 96, 256, 128


@contextmanager
def vllm_single_process():
    """vLLM's single-process distributed state (tensor parallel 1, gloo, a free loopback port),
    torn down on exit (the process group too, unless one was up before)."""
    from draftsmith.vllm_bridge.engine import configure_vllm_env

    configure_vllm_env()
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed.parallel_state import (
        destroy_distributed_environment,
        destroy_model_parallel,
        ensure_model_parallel_initialized,
        init_distributed_environment,
    )

    already = torch.distributed.is_available() and torch.distributed.is_initialized()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                     distributed_init_method=f"tcp://127.0.0.1:{port}", backend="gloo")
        ensure_model_parallel_initialized(1, 1)
    yield
    destroy_model_parallel()
    if not already:
        destroy_distributed_environment()


@contextmanager
def vllm_distributed(target: Path):
    """Writes a tiny target config to ``target`` (vLLM's ``ModelConfig`` of the verifier) and sets up
    :func:`vllm_single_process` for the block."""
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=128, num_hidden_layers=4, num_attention_heads=NH,
                num_key_value_heads=NKV, head_dim=HD, max_position_embeddings=512,
                tie_word_embeddings=False).save_pretrained(target)
    build_tokenizer(vocab_size=V).save_pretrained(target)
    with vllm_single_process():
        yield target


class CausalSDPA(torch.nn.Module):
    """Stands in for vLLM's attention kernel: ``(q [T, nh*hd], k, v [T, nkv*hd]) -> [T, nh*hd]``,
    causal over the T tokens of one sequence, query head i reading kv head i // (nh / nkv)."""

    def __init__(self, attn: torch.nn.Module):
        super().__init__()
        self.nh, self.nkv, self.hd, self.scale = attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scaling

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n = q.shape[0]
        q, k, v = (x.view(n, h, self.hd).transpose(0, 1) for x, h in ((q, self.nh), (k, self.nkv), (v, self.nkv)))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=True)
        return out.transpose(0, 1).reshape(n, self.nh * self.hd)


def loop_rms_norm(out, x, weight, eps):
    """A correct grouped RMSNorm written out per layer: ``out[l] = rmsnorm(x[l]) * weight[l]``."""
    for layer in range(weight.shape[0]):
        xl = x[layer].float()
        out[layer] = (xl / torch.sqrt(xl.pow(2).mean(-1, keepdim=True) + eps) * weight[layer].float()).to(out.dtype)


# ---------------------------------------------------------------------------------------------
# EAGLE-3 (and EAGLE-3.1) parity: our draft vs vLLM's llama_eagle3 built from our export

T = 12  # tokens of the parity sequence


def eagle3_draft_config(**kw):
    """A tiny EAGLE-3 draft geometry over the verifier of :func:`vllm_distributed`, fields ``kw``."""
    from draftsmith.models.eagle3.config import Eagle3Config

    return Eagle3Config(hidden_size=H, intermediate_size=I, num_attention_heads=NH, num_key_value_heads=NKV,
                        head_dim=HD, vocab_size=V, draft_vocab_size=VD, aux_layer_ids=[0, 1, 3],
                        max_position_embeddings=512, **kw)


def random_eagle3_draft(cfg, seed: int = 0):
    """``(model in eval mode, target embedding [V, H])``: a draft with every parameter random (norm
    weights too, so swapped or skipped norms show) and a non-trivial ``d2t`` (draft id i -> target id 2i)."""
    from draftsmith.models.eagle3.model import Eagle3DraftModel

    torch.manual_seed(seed)
    model = Eagle3DraftModel(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # every RMSNorm weight: layer norms, final norm, EAGLE-3.1 input_norm / fc_norm.{i}
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.2)
    embed = torch.randn(V, H)
    model.init_from_target(embed)
    model.set_vocab_mapping(torch.arange(VD), torch.arange(V) % 2 == 0)  # offset i -> target 2i
    return model.eval(), embed


def export_eagle3_draft(model, embed: torch.Tensor, out: Path, legacy: bool = False) -> Path:
    """``model`` saved as a training checkpoint under ``out/ckpt`` and exported with ``eval/export.py``
    to ``out/export`` (speculators format, or legacy); returns the export folder."""
    from draftsmith.eval.export import export

    write_draft_checkpoint(model, out / "ckpt", "eagle3", {"name_or_path": "tiny"}, ttt_steps=3)
    return export(out / "ckpt", out / "export", legacy=legacy, embed_tokens=embed)


def vllm_eagle3_draft(export_dir: Path, target: Path):
    """vLLM's ``Eagle3LlamaForCausalLM`` for ``export_dir``, built and loaded as its engine does (the
    ``config.json`` read by vLLM's ``SpeculativeConfig``, the weights through ``load_weights``, then
    ``process_weights_after_loading``), each layer's attention kernel replaced by :class:`CausalSDPA`."""
    from safetensors.torch import load_file
    from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM

    model_config = ModelConfig(model=str(target), dtype="float32", max_model_len=256, enforce_eager=True)
    parallel = ParallelConfig()
    spec = SpeculativeConfig(model=str(export_dir), method="eagle3", num_speculative_tokens=3,
                             target_model_config=model_config, target_parallel_config=parallel)
    config = VllmConfig(model_config=model_config, parallel_config=parallel, speculative_config=spec)
    with set_current_vllm_config(config):
        model = Eagle3LlamaForCausalLM(vllm_config=config)
        model.load_weights(load_file(str(export_dir / "model.safetensors")).items())
        process_weights_after_loading(model, spec.draft_model_config, torch.device("cpu"))
    for layer in model.model.layers:  # every draft layer (draft.num_layers)
        layer.self_attn.attn = CausalSDPA(layer.self_attn)
    return model.eval(), config


def run_eagle3_both(model, export_dir: Path, target: Path,
                    build=vllm_eagle3_draft) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{name: (ours, vLLM's)}`` of the first TTT step over one random sequence of T tokens:

    - ``g``: ours ``model.fuse`` vs vLLM's ``combine_hidden_states`` (EAGLE-3.1 ``input_norm`` /
      ``fc_norm`` included);
    - ``hidden``: the hidden state the next draft step reads, ours ``model.next_hidden`` of the
      step's output vs the second output of vLLM's ``LlamaModel.forward`` (its ``aux_output``: the
      pre-norm sum, or the post-norm hidden with ``norm_output``);
    - ``logits``: ours ``compute_logits`` vs vLLM's ``compute_logits`` (which scatters the draft
      vocab into the target vocab with ``d2t``; read back at ``i + d2t[i]``).

    ``build(export_dir, target) -> (vLLM model, its VllmConfig)``: :func:`vllm_eagle3_draft` (Llama)
    or :func:`vllm_eagle3_layer_draft` (the class vLLM's registry picks: Qwen3, DeepSeek MLA).
    """
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config

    vmodel, config = build(export_dir, target)
    gen = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, V, (1, T + 1), generator=gen)
    aux = torch.randn(1, T + 1, 3 * H, generator=gen)
    positions = torch.arange(T + 1).unsqueeze(0)
    with torch.no_grad():
        g = model.fuse(aux)
        # TTT step 0 (Eagle3DraftModel.forward): position t reads the embedding of x_{t+1} and g_t
        h = model.step(input_ids[:, 1:], g[:, :-1], positions[:, :-1], [])
        logits = model.compute_logits(h)
        torch.testing.assert_close(model(input_ids, aux, ttt_steps=1)[0][:, :-1], logits, rtol=0, atol=0)
        with set_current_vllm_config(config):
            # vLLM's proposer pairs each hidden state with the next token, at the same position
            g_v = vmodel.combine_hidden_states(aux[0])
            normed, passed_on = vmodel(input_ids[0, 1:], positions[0, :-1], g_v[:-1])
            full = vmodel.compute_logits(normed)  # [T, V], draft logits scattered to i + d2t[i]
    d2t = load_file(str(export_dir / "model.safetensors"))["d2t"]
    return {"g": (g[0], g_v), "hidden": (model.next_hidden(h)[0], passed_on),
            "logits": (logits[0], full[:, torch.arange(VD) + d2t])}


def assert_parity(outs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Every ``(ours, vLLM's)`` pair equal to 1e-5 (float32); the message names the pair."""
    for name, (ours, theirs) in outs.items():
        torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def vllm_names(exported: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The exported tensors under the names vLLM's ``DFlashQwen3ForCausalLM`` (and its DSpark
    subclass) gives them: q/k/v and gate/up stacked into ``qkv_proj`` / ``gate_up_proj``, ``d2t`` as
    ``draft_id_to_target_id``, ``model.`` in front of all but ``lm_head``; ``t2d`` is not loaded."""
    w = dict(exported)
    out = {}
    layers = sorted({k.split(".")[1] for k in w if k.startswith("layers.")})
    for i in layers:
        for a, parts, fused in (("self_attn", ("q_proj", "k_proj", "v_proj"), "qkv_proj"),
                                ("mlp", ("gate_proj", "up_proj"), "gate_up_proj")):
            out[f"model.layers.{i}.{a}.{fused}.weight"] = torch.cat([w.pop(f"layers.{i}.{a}.{p}.weight")
                                                                     for p in parts])
    if "d2t" in w:
        out["draft_id_to_target_id"] = w.pop("d2t")
        w.pop("t2d")
    out.update({(k if k.startswith("lm_head") else "model." + k): v for k, v in w.items()})
    return out


# ---------------------------------------------------------------------------------------------
# EAGLE-3 draft layers of other families (draft.layer qwen3 / mla): vLLM's qwen3_eagle3 and
# deepseek_eagle3 built from our export by the class its model registry resolves

class CausalMLA(torch.nn.Module):
    """Stands in for vLLM's MLA attention kernel (``MultiHeadLatentAttentionWrapper.mla_attn``, an
    ``MLAAttention`` that reads the engine's forward context and latent KV cache): ``(q [T, nh,
    qk_nope + qk_rope], kv_c_normed [T, kv_lora_rank], k_pe [T, 1, qk_rope], output_shape) -> [T, nh *
    v_head_dim]``, the decompressed form of vLLM's MLA prefill: ``kv_b_proj(kv_c_normed)`` split per
    head into ``k_nope`` and ``v``, keys ``[k_nope ; k_pe]`` (``k_pe`` shared by the heads), causal
    SDPA over the T tokens of one sequence at the layer's ``scaling`` (YaRN's mscale included).
    Everything before it (fused_qkv_a_proj, the latent norms, q_b_proj, DeepSeek RoPE) and after it
    (o_proj) is vLLM's own; ``kv_b_proj`` is the layer's own module too."""

    def __init__(self, attn: torch.nn.Module):
        super().__init__()
        self.kv_b_proj, self.scale = attn.kv_b_proj, attn.scaling
        self.nh, self.nope, self.hd_v = attn.num_local_heads, attn.qk_nope_head_dim, attn.v_head_dim

    def forward(self, q, kv_c_normed, k_pe, output_shape, **_):
        n = q.shape[0]
        kv = self.kv_b_proj(kv_c_normed)[0].view(n, self.nh, self.nope + self.hd_v)
        k_nope, v = kv.split([self.nope, self.hd_v], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(n, self.nh, k_pe.shape[-1])], dim=-1)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                             is_causal=True, scale=self.scale)
        return out.transpose(0, 1).reshape(output_shape)


def eagle3_layer_draft_config(layer: str, **kw):
    """A tiny EAGLE-3 draft of ``layer`` (``qwen3`` / ``mla``) over the verifier of
    :func:`vllm_distributed`, fields ``kw``; the MLA one has 4 heads, query LoRA rank 24, latent 32,
    qk 16 + 8 (RoPE), v 12."""
    from draftsmith.models.eagle3.config import Eagle3Config

    if layer != "mla":
        return eagle3_draft_config(layer=layer, **kw)
    kw = dict(q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12) | kw
    return Eagle3Config(hidden_size=H, intermediate_size=I, num_attention_heads=NH, num_key_value_heads=NH,
                        head_dim=kw["qk_nope_head_dim"] + kw["qk_rope_head_dim"], vocab_size=V, draft_vocab_size=VD,
                        aux_layer_ids=[0, 1, 3], max_position_embeddings=512, layer="mla", **kw)


def vllm_eagle3_layer_draft(export_dir: Path, target: Path):
    """vLLM's draft for ``export_dir`` as :func:`vllm_eagle3_draft` builds Llama's, its class the one
    vLLM's model registry resolves from the draft config its ``SpeculativeConfig`` reads
    (``Eagle3Qwen3ForCausalLM``, ``Eagle3DeepseekV2ForCausalLM``, ...); the attention kernel replaced
    by :class:`CausalSDPA`, or in an MLA layer by :class:`CausalMLA`, with vLLM's rotary embedding
    run through its ``forward_native`` (see the comment below)."""
    from safetensors.torch import load_file
    from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.model_loader.utils import get_model_architecture, process_weights_after_loading
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # as an engine does: ours routes small MLA shapes off AMX_MLA on AMX CPUs
    model_config = ModelConfig(model=str(target), dtype="float32", max_model_len=256, enforce_eager=True)
    parallel = ParallelConfig()
    spec = SpeculativeConfig(model=str(export_dir), method="eagle3", num_speculative_tokens=3,
                             target_model_config=model_config, target_parallel_config=parallel)
    config = VllmConfig(model_config=model_config, parallel_config=parallel, speculative_config=spec)
    cls, _ = get_model_architecture(spec.draft_model_config)
    with set_current_vllm_config(config):
        model = cls(vllm_config=config)
        model.load_weights(load_file(str(export_dir / "model.safetensors")).items())
        process_weights_after_loading(model, spec.draft_model_config, torch.device("cpu"))
    for layer in model.model.layers:  # every draft layer (draft.num_layers)
        attn = layer.self_attn
        if hasattr(attn, "mla_attn"):
            attn.mla_attn.mla_attn = CausalMLA(attn)
            # vLLM's CPU rotary op (ops.rotary_embedding, RotaryEmbedding.forward_cpu) rotates in place
            # assuming contiguous heads; MLA hands it strided views (q[..., qk_nope:], k_pe split off the
            # latent), which it misreads (a CUDA kernel takes the strides). Its PyTorch reference
            # forward_native, the same rotation, runs instead.
            attn.rotary_emb._forward_method = attn.rotary_emb.forward_native
        else:
            attn.attn = CausalSDPA(attn)
    return model.eval(), config


def capture_with_vllm(target: Path, layer_ids: list[int], records: list[dict], dtype: str,
                      work_dir: Path) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """``{record index: (aux (T, 3H), final (T, H))}`` on the CPU: ``records`` (``{"id",
    "input_ids"}``) through :class:`draftsmith.target.vllm_capture.VllmHiddenStateCapture` of
    ``target`` at ``dtype`` with this machine's engine settings (eager, max_model_len 256), the
    engine closed after."""
    from draftsmith.recipe import VllmConfig
    from draftsmith.target.vllm_capture import VllmHiddenStateCapture

    engine = VllmHiddenStateCapture(target, layer_ids, VllmConfig(
        dtype=dtype, enforce_eager=True, gpu_memory_utilization=0.2, max_model_len=256, max_num_seqs=8),
        work_dir=work_dir)
    try:
        got = {j: (aux.cpu(), final.cpu()) for j, aux, final in engine.capture(records)}
    finally:
        engine.close()
    assert sorted(got) == list(range(len(records)))
    return got
