"""Parity of OUR EAGLE-3 draft (models/eagle3/model.py) with vLLM's ``llama_eagle3`` draft, layer by layer.

A tiny random :class:`Eagle3DraftModel` is exported with ``eval/export.py``; vLLM's own
``Eagle3LlamaForCausalLM`` is built from that export the way its engine builds it (the draft's
``config.json`` read by vLLM's ``SpeculativeConfig`` / speculators config reader, the weights fed
through vLLM's ``load_weights`` / ``weight_loader`` path, then ``process_weights_after_loading``),
and both run the first TTT step on the same inputs:

- ``g = fc(cat(aux))``: ours ``model.fc`` vs vLLM ``combine_hidden_states``;
- the layer's pre-norm output hidden state: ours ``model.step`` vs the second output of vLLM's
  ``LlamaModel.forward`` (its ``RMSNorm(hidden, residual)`` pre-norm sum);
- the draft-vocab logits: ours ``compute_logits`` vs vLLM's ``compute_logits`` (which scatters the
  draft vocab into the target vocab with ``d2t``; read back at ``i + d2t[i]``).

Only one thing of vLLM's is replaced: the attention *kernel* (``self_attn.attn``), which reads
the engine's forward context and paged KV cache, by a plain causal SDPA over the same q / k / v
(vLLM's qkv_proj, split, rotary embedding and o_proj all run). So the test fails when the
export's tensor names, the ``cat(embeds, hidden)`` order, the ``fc`` orientation, the residual
that ``norm_before_residual`` selects (and the config key vLLM reads it from), the q/k/v/GQA head
layout, RoPE, biases or ``d2t`` differ from what vLLM computes; the ``mutation`` tests below
check that it does fail for some of them.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftsmith.eval.export import export
from draftsmith.models.eagle3.config import Eagle3Config
from draftsmith.models.eagle3.model import Eagle3DecoderLayer, Eagle3DraftModel

from helpers.tiny import write_draft_checkpoint
from helpers.vllm_parity import HD, NH, NKV, VD, CausalSDPA, H, I, V

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed"),
]

T = 12
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}

CASES = {
    "norm_before_residual": dict(norm_before_residual=True),
    "paper_residual": dict(norm_before_residual=False),
    "biases": dict(norm_before_residual=True, attention_bias=True, mlp_bias=True),
    "llama3_rope": dict(norm_before_residual=False, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE),
}


def draft_config(**kw) -> Eagle3Config:
    return Eagle3Config(hidden_size=H, intermediate_size=I, num_attention_heads=NH, num_key_value_heads=NKV,
                        head_dim=HD, vocab_size=V, draft_vocab_size=VD, aux_layer_ids=[0, 1, 3],
                        max_position_embeddings=512, **kw)


def random_draft(cfg: Eagle3Config, seed: int = 0) -> tuple[Eagle3DraftModel, torch.Tensor]:
    """A draft with every parameter random (norm weights too, so swapped norms show) and a
    non-trivial ``d2t`` (draft id i -> target id 2i)."""
    torch.manual_seed(seed)
    model = Eagle3DraftModel(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.2)
    embed = torch.randn(V, H)
    model.init_from_target(embed)
    model.set_vocab_mapping(torch.arange(VD), torch.arange(V) % 2 == 0)  # offset i -> target 2i
    return model.eval(), embed


def export_draft(model: Eagle3DraftModel, embed: torch.Tensor, out: Path, legacy: bool) -> Path:
    write_draft_checkpoint(model, out / "ckpt", "eagle3", {"name_or_path": "tiny"}, ttt_steps=3)
    return export(out / "ckpt", out / "export", legacy=legacy, embed_tokens=embed)


def vllm_draft(export_dir: Path, target: Path):
    """vLLM's ``Eagle3LlamaForCausalLM`` for ``export_dir``, built and loaded as its engine does."""
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
    attn = model.model.layers[0].self_attn
    attn.attn = CausalSDPA(attn)
    return model.eval(), config


def run_both(model: Eagle3DraftModel, export_dir: Path, target: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{name: (ours, vLLM's)}`` for g, the layer's pre-norm output and the draft-vocab logits of
    the first TTT step over one random sequence of T tokens."""
    from vllm.config import set_current_vllm_config

    vmodel, config = vllm_draft(export_dir, target)
    gen = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, V, (1, T + 1), generator=gen)
    aux = torch.randn(1, T + 1, 3 * H, generator=gen)
    positions = torch.arange(T + 1).unsqueeze(0)
    with torch.no_grad():
        g = model.fc(aux)
        # TTT step 0 (Eagle3DraftModel.forward): position t reads the embedding of x_{t+1} and g_t
        h = model.step(input_ids[:, 1:], g[:, :-1], positions[:, :-1], [])
        logits = model.compute_logits(h)
        torch.testing.assert_close(model(input_ids, aux, ttt_steps=1)[0][:, :-1], logits, rtol=0, atol=0)
        with set_current_vllm_config(config):
            # vLLM's proposer pairs each hidden state with the next token, at the same position
            g_v = vmodel.combine_hidden_states(aux[0])
            normed, prenorm = vmodel(input_ids[0, 1:], positions[0, :-1], g_v[:-1])
            full = vmodel.compute_logits(normed)  # [T, V], draft logits scattered to i + d2t[i]
    d2t = load_file(str(export_dir / "model.safetensors"))["d2t"]
    return {"g": (g[0], g_v), "hidden": (h[0], prenorm),
            "logits": (logits[0], full[:, torch.arange(VD) + d2t])}


def assert_parity(outs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    for name, (ours, theirs) in outs.items():
        torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("legacy", [False, True], ids=["speculators", "legacy"])
@pytest.mark.parametrize("case", CASES)
def test_first_ttt_step_matches_vllm_llama_eagle3(vllm_env, tmp_path, case, legacy):
    model, embed = random_draft(draft_config(**CASES[case]))
    export_dir = export_draft(model, embed, tmp_path, legacy)
    outs = run_both(model, export_dir, vllm_env)
    assert_parity(outs)
    assert outs["logits"][0].abs().max() > 1.0  # a real signal, not zeros on both sides


def _flip_norm_before_residual(export_dir: Path, monkeypatch) -> None:
    path = export_dir / "config.json"
    cfg = json.loads(path.read_text())
    cfg["norm_before_residual"] = not cfg["norm_before_residual"]
    path.write_text(json.dumps(cfg))


def _swap_gate_and_up(export_dir: Path, monkeypatch) -> None:
    path = export_dir / "model.safetensors"
    w = load_file(str(path))
    gate, up = "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight"
    w[gate], w[up] = w[up], w[gate]
    save_file(w, str(path))


def _swap_concat_order(export_dir: Path, monkeypatch) -> None:
    def swapped(self, embeds, hidden):
        normed_hidden = self.hidden_norm(hidden)
        residual = normed_hidden if self.norm_before_residual else hidden
        return torch.cat([normed_hidden, self.input_layernorm(embeds)], dim=-1), residual

    monkeypatch.setattr(Eagle3DecoderLayer, "_input", swapped)


def _swap_kv_heads(export_dir: Path, monkeypatch) -> None:
    path = export_dir / "model.safetensors"
    w = load_file(str(path))
    k = "layers.0.self_attn.k_proj.weight"
    w[k] = torch.cat(list(w[k].view(NKV, HD, -1).flip(0)), dim=0).contiguous()
    save_file(w, str(path))


@pytest.mark.parametrize("mutation", [_flip_norm_before_residual, _swap_gate_and_up, _swap_concat_order,
                                      _swap_kv_heads], ids=lambda f: f.__name__.strip("_"))
def test_parity_check_fails_when_export_or_model_disagree_with_vllm(vllm_env, tmp_path, monkeypatch, mutation):
    model, embed = random_draft(draft_config(norm_before_residual=True))
    export_dir = export_draft(model, embed, tmp_path, legacy=False)
    mutation(export_dir, monkeypatch)
    with pytest.raises(AssertionError, match="hidden"):
        assert_parity(run_both(model, export_dir, vllm_env))
