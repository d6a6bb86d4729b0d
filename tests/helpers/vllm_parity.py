"""What the vLLM parity tests (EAGLE-3, P-EAGLE, DFlash and DSpark run through vLLM's own modules)
share: the verifier's geometry, vLLM's single-process distributed state, a stand-in attention
kernel and the names vLLM's DFlash / DSpark loaders give the exported tensors."""

from __future__ import annotations

import socket
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F

from helpers.tiny import build_tokenizer

# the verifier's geometry: hidden, heads, kv heads, head dim, intermediate, vocab, draft vocab
H, NH, NKV, HD, I, V, VD = 64, 4, 2, 16, 96, 256, 128


@contextmanager
def vllm_distributed(target: Path):
    """Writes a tiny target config to ``target`` (vLLM's ``ModelConfig`` of the verifier), sets up
    vLLM's single-process distributed state (tensor parallel 1, gloo) and tears it down on exit."""
    from transformers import LlamaConfig

    from draftsmith.vllm_bridge.engine import configure_vllm_env

    configure_vllm_env()
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed.parallel_state import (
        destroy_distributed_environment,
        destroy_model_parallel,
        ensure_model_parallel_initialized,
        init_distributed_environment,
    )

    LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=128, num_hidden_layers=4, num_attention_heads=NH,
                num_key_value_heads=NKV, head_dim=HD, max_position_embeddings=512,
                tie_word_embeddings=False).save_pretrained(target)
    build_tokenizer(vocab_size=V).save_pretrained(target)

    already = torch.distributed.is_available() and torch.distributed.is_initialized()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                     distributed_init_method=f"tcp://127.0.0.1:{port}", backend="gloo")
        ensure_model_parallel_initialized(1, 1)
    yield target
    destroy_model_parallel()
    if not already:
        destroy_distributed_environment()


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
