"""Parity of OUR EAGLE-3 draft layers of other families (``draft.layer: qwen3`` / ``mla``;
models/eagle3/attention.py, models/eagle3/mla.py) with vLLM's ``qwen3_eagle3`` and ``deepseek_eagle3``.

As tests/with_vllm/test_vllm_eagle3_parity.py does for the Llama layer: a tiny random
:class:`Eagle3DraftModel` is exported with ``eval/export.py``; vLLM builds its draft from that
export as its engine does (the ``config.json`` read by its ``SpeculativeConfig``, the class its
model registry resolves from that config, which the test checks is ``Eagle3Qwen3ForCausalLM`` /
``Eagle3DeepseekV2ForCausalLM``, the weights through its ``load_weights``, then
``process_weights_after_loading``), and both run the first TTT step on the same inputs; ``g``,
the hidden state the next step reads and the draft-vocab logits must agree to 1e-5 in float32
(tests/helpers/vllm_parity.py).

What is replaced of vLLM's, and nothing else:

- Qwen3: the attention kernel ``self_attn.attn`` (it reads the engine's forward context and paged
  KV cache) by a causal SDPA over vLLM's own q / k / v (:class:`~helpers.vllm_parity.CausalSDPA`):
  vLLM's qkv_proj, per-head ``q_norm`` / ``k_norm``, rotary embedding and o_proj all run.
- MLA: the MLA kernel ``self_attn.mla_attn.mla_attn`` (vLLM's ``MLAAttention``, whose CPU path
  needs the engine's forward context and latent KV cache) by the decompressed attention of vLLM's
  MLA prefill (:class:`~helpers.vllm_parity.CausalMLA`): the layer's own ``kv_b_proj`` applied to
  vLLM's normed latent, keys ``[k_nope ; k_pe]``, causal SDPA at vLLM's ``scaling``. vLLM's
  ``fused_qkv_a_proj`` (or ``kv_a_proj_with_mqa`` / ``q_proj``), ``q_a_layernorm`` /
  ``kv_a_layernorm``, ``q_b_proj``, its DeepSeek RoPE (interleaved pairs, YaRN) and ``o_proj`` run.

The mutation tests check that the comparison fails when the export or our layer differs from vLLM's
in one place.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftsmith.models.eagle3 import mla as mla_module
from draftsmith.models.eagle3.attention import Qwen3Eagle3Attention

from helpers.vllm_parity import (
    assert_parity,
    eagle3_layer_draft_config,
    export_eagle3_draft,
    random_eagle3_draft,
    run_eagle3_both,
    vllm_eagle3_layer_draft,
)

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed"),
]

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 0.7,
        "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}

CASES = {
    "qwen3": ("qwen3", dict(norm_before_residual=True)),
    "qwen3_paper_residual": ("qwen3", dict(norm_before_residual=False)),
    "qwen3_qkv_bias": ("qwen3", dict(attention_bias=True, rope_theta=1000000.0)),
    "qwen3_eagle31": ("qwen3", dict(norm_before_fc=True, fc_norm=True, norm_output=True)),
    "mla": ("mla", dict(norm_before_residual=True)),
    "mla_paper_residual": ("mla", dict(norm_before_residual=False)),
    "mla_yarn": ("mla", dict(rope_scaling=YARN)),
    "mla_eagle31": ("mla", dict(fc_norm=True, norm_output=True)),
    "qwen3_two_layers": ("qwen3", dict(num_layers=2)),
    "mla_two_layers": ("mla", dict(num_layers=2)),
}
VLLM_CLASS = {"qwen3": "Eagle3Qwen3ForCausalLM", "mla": "Eagle3DeepseekV2ForCausalLM"}


def _export(tmp_path: Path, layer: str, legacy: bool = False, **kw):
    model, embed = random_eagle3_draft(eagle3_layer_draft_config(layer, **kw))
    return model, export_eagle3_draft(model, embed, tmp_path, legacy)


def _built(classes: list[str]):
    def build(export_dir: Path, target: Path):
        vmodel, config = vllm_eagle3_layer_draft(export_dir, target)
        classes.append(type(vmodel).__name__)
        return vmodel, config
    return build


# Qwen3 layers in both layouts; the MLA layer has one (test_mla_export_is_the_deepseek_v2_layout)
LAYOUTS = [(case, legacy) for case, (layer, _) in CASES.items() for legacy in ((False, True) if layer == "qwen3" else (False,))]


@pytest.mark.parametrize("case,legacy", LAYOUTS,
                         ids=[f"{c}-{'legacy' if l else 'default'}" for c, l in LAYOUTS])
def test_first_ttt_step_matches_vllm(vllm_env, tmp_path, case, legacy):
    layer, kw = CASES[case]
    model, export_dir = _export(tmp_path, layer, legacy, **kw)
    classes: list[str] = []
    outs = run_eagle3_both(model, export_dir, vllm_env, build=_built(classes))
    assert classes == [VLLM_CLASS[layer]]
    assert_parity(outs)
    assert outs["logits"][0].abs().max() > 1.0  # a real signal, not zeros on both sides
    for name, (ours, theirs) in outs.items():  # the numbers the report quotes
        print(f"{case} {name}: max abs {(ours - theirs).abs().max():.2e}, "
              f"relative to max abs value {(ours - theirs).abs().max() / ours.abs().max():.2e}")


def test_mla_export_is_the_deepseek_v2_layout(tmp_path):
    """The MLA draft is written as vLLM 0.32 can build it whatever layout was asked for: a
    ``deepseek_v2`` config (vLLM turns a ``deepseek_v3`` draft config into its MTP draft) with
    ``architectures ["Eagle3DeepseekV2ForCausalLM"]`` and the latent attention geometry."""
    _, export_dir = _export(tmp_path, "mla")
    cfg = json.loads((export_dir / "config.json").read_text())
    assert cfg["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and cfg["model_type"] == "deepseek_v2"
    assert (cfg["q_lora_rank"], cfg["kv_lora_rank"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"],
            cfg["v_head_dim"]) == (24, 32, 16, 8, 12)
    assert "speculators_config" not in cfg


# -- mutations: each must make the comparison fail

def _swap_q_and_k_norm(export_dir: Path, monkeypatch) -> None:
    path = export_dir / "model.safetensors"
    w = load_file(str(path))
    q, k = "layers.0.self_attn.q_norm.weight", "layers.0.self_attn.k_norm.weight"
    w[q], w[k] = w[k], w[q]
    save_file(w, str(path))


def _skip_k_norm(export_dir: Path, monkeypatch) -> None:
    def qkv(self, x, cos, sin):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, self.nh, self.hd)).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        return (*apply_rotary_pos_emb(q, k, cos, sin), v)

    monkeypatch.setattr(Qwen3Eagle3Attention, "_qkv", qkv)


def _flip_norm_before_residual(export_dir: Path, monkeypatch) -> None:
    path = export_dir / "config.json"
    cfg = json.loads(path.read_text())
    cfg["norm_before_residual"] = not cfg["norm_before_residual"]
    path.write_text(json.dumps(cfg))


def _swap_nope_and_value_rows(export_dir: Path, monkeypatch) -> None:
    """kv_b_proj's rows per head as [v ; k_nope] instead of DeepSeek's [k_nope ; v] (v 12 of 16 + 12)."""
    path = export_dir / "model.safetensors"
    w = load_file(str(path))
    name = "midlayer.self_attn.kv_b_proj.weight"
    heads = w[name].view(4, 16 + 12, -1)
    w[name] = torch.cat([heads[:, 16:], heads[:, :16]], dim=1).reshape(w[name].shape).contiguous()
    save_file(w, str(path))


def _rotate_half_rope(export_dir: Path, monkeypatch) -> None:
    """Our MLA RoPE in Llama's rotate-half layout instead of DeepSeek's interleaved pairs."""
    def neox(x, cos, sin):
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        cos, sin = (torch.cat([c[..., ::2], c[..., ::2]], dim=-1) for c in (cos, sin))
        return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)

    monkeypatch.setattr(mla_module, "apply_interleaved_rope", neox)


MUTATIONS = {
    "qwen3": [_swap_q_and_k_norm, _skip_k_norm, _flip_norm_before_residual],
    "mla": [_swap_nope_and_value_rows, _rotate_half_rope, _flip_norm_before_residual],
}


@pytest.mark.parametrize("layer,mutation", [(layer, m) for layer, ms in MUTATIONS.items() for m in ms],
                         ids=lambda v: v if isinstance(v, str) else v.__name__.strip("_"))
def test_parity_check_fails_when_export_or_model_disagree_with_vllm(vllm_env, tmp_path, monkeypatch, layer,
                                                                      mutation):
    model, export_dir = _export(tmp_path, layer, norm_before_residual=True)
    mutation(export_dir, monkeypatch)
    with pytest.raises(AssertionError, match="hidden"):
        assert_parity(run_eagle3_both(model, export_dir, vllm_env, build=vllm_eagle3_layer_draft))


def test_parity_check_fails_without_yarn_softmax_mscale(vllm_env, tmp_path, monkeypatch):
    """Our MLA softmax scale without YaRN's ``mscale_all_dim`` factor (vLLM multiplies it in)."""
    monkeypatch.setattr(mla_module, "yarn_mscale", lambda factor, mscale=1.0: 1.0)
    model, export_dir = _export(tmp_path, "mla", rope_scaling=YARN)
    with pytest.raises(AssertionError, match="hidden"):
        assert_parity(run_eagle3_both(model, export_dir, vllm_env, build=vllm_eagle3_layer_draft))
