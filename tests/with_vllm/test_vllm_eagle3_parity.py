"""Parity of OUR EAGLE-3 draft (models/eagle3/model.py) with vLLM's ``llama_eagle3`` draft, layer by layer.

A tiny random :class:`Eagle3DraftModel` is exported with ``eval/export.py``; vLLM's own
``Eagle3LlamaForCausalLM`` is built from that export the way its engine builds it (the draft's
``config.json`` read by vLLM's ``SpeculativeConfig`` / speculators config reader, the weights fed
through vLLM's ``load_weights`` / ``weight_loader`` path, then ``process_weights_after_loading``),
and both run the first TTT step on the same inputs (tests/helpers/vllm_parity.py, shared with
the EAGLE-3.1 parity test):

- ``g = fc(cat(aux))``: ours ``model.fuse`` vs vLLM ``combine_hidden_states``;
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

from draftsmith.models.eagle3.model import Eagle3DecoderLayer

from helpers.vllm_parity import (
    HD,
    NKV,
    assert_parity,
    eagle3_draft_config,
    export_eagle3_draft,
    random_eagle3_draft,
    run_eagle3_both,
)

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed"),
]

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}

CASES = {
    "norm_before_residual": dict(norm_before_residual=True),
    "paper_residual": dict(norm_before_residual=False),
    "biases": dict(norm_before_residual=True, attention_bias=True, mlp_bias=True),
    "llama3_rope": dict(norm_before_residual=False, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE),
    # draft.num_layers: vLLM's llama_eagle3 builds num_hidden_layers layers, the later ones on the hidden state only
    "two_layers": dict(norm_before_residual=True, num_layers=2),
    "three_layers_paper_residual": dict(norm_before_residual=False, num_layers=3, attention_bias=True),
}


@pytest.mark.parametrize("legacy", [False, True], ids=["speculators", "legacy"])
@pytest.mark.parametrize("case", CASES)
def test_first_ttt_step_matches_vllm_llama_eagle3(vllm_env, tmp_path, case, legacy):
    model, embed = random_eagle3_draft(eagle3_draft_config(**CASES[case]))
    export_dir = export_eagle3_draft(model, embed, tmp_path, legacy)
    outs = run_eagle3_both(model, export_dir, vllm_env)
    assert_parity(outs)
    assert outs["logits"][0].abs().max() > 1.0  # a real signal, not zeros on both sides


def test_a_two_layer_draft_is_not_served_as_one_layer(vllm_env, tmp_path):
    """``num_hidden_layers`` is what vLLM builds from: the same export with 1 in its config is
    refused at load (``layers.1.*`` has no module), not served as a truncated draft."""
    model, embed = random_eagle3_draft(eagle3_draft_config(norm_before_residual=True, num_layers=2))
    export_dir = export_eagle3_draft(model, embed, tmp_path)
    path = export_dir / "config.json"
    cfg = json.loads(path.read_text())
    assert cfg["transformer_layer_config"]["num_hidden_layers"] == 2
    cfg["transformer_layer_config"]["num_hidden_layers"] = 1
    cfg["transformer_layer_config"]["layer_types"] = cfg["transformer_layer_config"]["layer_types"][:1]
    path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="no module or parameter named 'layers.1'"):
        run_eagle3_both(model, export_dir, vllm_env)


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
    model, embed = random_eagle3_draft(eagle3_draft_config(norm_before_residual=True))
    export_dir = export_eagle3_draft(model, embed, tmp_path, legacy=False)
    mutation(export_dir, monkeypatch)
    with pytest.raises(AssertionError, match="hidden"):
        assert_parity(run_eagle3_both(model, export_dir, vllm_env))
