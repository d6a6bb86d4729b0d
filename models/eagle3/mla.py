"""Multi-head latent attention (MLA, DeepSeek-V2: arXiv:2405.04434) as the EAGLE-3 draft layer's
attention (``layer: mla``), computed as vLLM's ``deepseek_eagle3`` draft computes it.

The layer input ``x`` (``[norm(embeds) ; hidden_norm(g)]``, 2H wide) is projected to

    q      = q_b_proj(q_a_layernorm(q_a_proj(x)))     # rank q_lora_rank
    c, kpe = split(kv_a_proj_with_mqa(x), [kv_lora_rank, qk_rope_head_dim])
    k_nope, v = split(kv_b_proj(kv_a_layernorm(c)), [qk_nope_head_dim, v_head_dim])   # per head

and each head attends with the query ``[q_nope ; rope(q_pe)]`` over the keys
``[k_nope ; rope(kpe)]`` (the RoPE part ``kpe`` is one ``qk_rope_head_dim`` vector shared by all
heads), softmax scale ``1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)`` (times ``mscale**2``
under DeepSeek's YaRN), values ``v_head_dim`` wide, then ``o_proj``. This is the decompressed
("MHA") form vLLM runs for prefill; its decode kernels absorb ``kv_b_proj`` into the query and
output instead and cache only ``c`` and ``kpe``, the same attention in another order. Training
keeps the decompressed keys and values of each TTT step, so the step attention is the one
:func:`~draftsmith.models.eagle3.attention.ttt_attention` every EAGLE-3 layer runs (SDPA or
flex-attention with the unroll's :class:`~draftsmith.models.eagle3.masks.TTTMask`).

RoPE is DeepSeek's: it rotates the ``qk_rope_head_dim`` channels in interleaved pairs
``(x[2i], x[2i+1])`` (vLLM's ``is_neox_style=False``), with DeepSeek's YaRN when the config's
``rope_scaling`` is ``yarn`` (:class:`DeepseekRotaryEmbedding`).

Tensor names are the DeepSeek-V2/V3 checkpoints' (and vLLM's before it fuses ``q_a_proj`` with
``kv_a_proj_with_mqa`` into ``fused_qkv_a_proj``): ``self_attn.{q_a_proj, q_a_layernorm,
q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj}``. The full-rank query of
DeepSeek-V2-Lite (``q_proj``) is not built: vLLM 0.32's ``deepseek_eagle3`` cannot load it
(:data:`~draftsmith.models.eagle3.config.MLA_FULL_RANK_QUERY`).

Shapes: B batch, T positions, H hidden size, nh heads, hd_qk = qk_nope_head_dim +
qk_rope_head_dim, hd_v = v_head_dim, r = qk_rope_head_dim.
"""

from __future__ import annotations

import math
import torch
from torch import nn

from ..common import RMSNorm
from .attention import TTTAttention
from .config import Eagle3Config


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """DeepSeek's YaRN magnitude ``0.1 * mscale * ln(factor) + 1`` (1 for ``factor <= 1``)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def deepseek_rope(config: Eagle3Config) -> tuple[torch.Tensor, float, float]:
    """``(inv_freq (r / 2,), cos/sin magnitude, softmax-scale factor)`` of the MLA layer's RoPE, as
    vLLM 0.32 builds it (``get_rope(..., is_neox_style=False)`` in ``DeepseekV2MLAAttention``).

    Without scaling: ``theta ** (-2i / r)``, magnitude 1, factor 1. With ``rope_scaling`` of type
    ``yarn`` (vLLM's ``deepseek_yarn``; keys ``factor``, ``original_max_position_embeddings`` and
    optionally ``beta_fast`` (32), ``beta_slow`` (1), ``mscale`` (1), ``mscale_all_dim`` (0)): the
    frequencies blend interpolated (``/ factor``) and original ones over YaRN's correction range,
    cos / sin carry ``yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)`` and, unless
    ``attention_factor`` is 1 (vLLM's ``deepseek_llama_scaling``), the softmax scale is multiplied
    by ``yarn_mscale(factor, mscale_all_dim) ** 2``.
    """
    r, base = config.qk_rope_head_dim, config.rope_theta
    pos_freqs = base ** (torch.arange(0, r, 2, dtype=torch.float) / r)
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type", "default")) == "default":
        return 1.0 / pos_freqs, 1.0, 1.0
    factor = float(scaling["factor"])
    original = scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast", 32), scaling.get("beta_slow", 1)

    def correction_dim(rotations: float) -> float:  # the channel whose wavelength fits `rotations` times
        return (r * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), r - 1)
    ramp = (torch.arange(r // 2, dtype=torch.float) - low) / ((high - low) or 0.001)
    extrapolate = 1 - ramp.clamp(0, 1)  # per frequency: 1 keeps the original, 0 interpolates
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    magnitude = yarn_mscale(factor, float(scaling.get("mscale", 1))) / yarn_mscale(
        factor, float(scaling.get("mscale_all_dim", 0)))
    softmax = 1.0 if scaling.get("attention_factor") == 1.0 else yarn_mscale(
        factor, float(scaling.get("mscale_all_dim", 0))) ** 2
    return inv_freq, magnitude, softmax


class DeepseekRotaryEmbedding(nn.Module):
    """The MLA layer's RoPE tables: ``(x, position_ids (B, N))`` -> ``cos, sin`` ``(B, N, r)`` in
    ``x``'s dtype, each frequency repeated for its channel pair (interleaved layout, see
    :func:`apply_interleaved_rope`), scaled by DeepSeek's YaRN magnitude (:func:`deepseek_rope`).
    Called as the Llama layer's ``LlamaRotaryEmbedding`` is, once per TTT unroll."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        inv_freq, self.magnitude, self.softmax_factor = deepseek_rope(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids.float()[..., None] * self.inv_freq.to(x.device)  # (B, N, r / 2), fp32
        freqs = freqs.repeat_interleave(2, dim=-1)  # (B, N, r): channel pair i shares frequency i
        return (freqs.cos() * self.magnitude).to(x.dtype), (freqs.sin() * self.magnitude).to(x.dtype)


def apply_interleaved_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs ``(x[2i], x[2i+1])`` of ``x (B, heads, T, r)`` by the angles of ``cos`` /
    ``sin (B, T, r)`` (vLLM's ``is_neox_style=False``, GPT-J's layout)."""
    pairs = x.unflatten(-1, (-1, 2))
    rotated = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)  # (-x1, x0) per pair
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)


def pad_values(v: torch.Tensor, width: int) -> torch.Tensor:
    """``v (..., hd_v)`` zero-padded to ``(..., width)``: the attention's output over padded values
    is the true output in its first ``hd_v`` channels and zeros after them, and with q, k and v of one
    width every fused attention kernel takes the call (torch's flash and memory-efficient SDPA
    kernels, the CPU's flash kernel, flex-attention). With DeepSeek-V3's widths (192 against 128)
    SDPA otherwise falls back to the math path, which materialises the ``T x (k+1)T`` scores of every
    head (docs/targets.md). The padding costs 50% more value bytes and PV work; its gradient is
    sliced off by ``F.pad``'s backward."""
    return v if v.shape[-1] >= width else torch.nn.functional.pad(v, (0, width - v.shape[-1]))


class MLAEagle3Attention(TTTAttention):
    """Multi-head latent attention over ``[embedding ; hidden]`` (2H) for the EAGLE-3 draft layer
    (module docstring). Each step's keys ``(B, nh, T, hd_qk)`` and values ``(B, nh, T, hd_v)`` are
    the decompressed ones, the values zero-padded to ``hd_qk`` (:func:`pad_values`; the TTT cache
    and :class:`~draftsmith.models.eagle3.attention.Eagle3KVCache` keep them padded). No biases
    (vLLM's MLA has none)."""

    def __init__(self, config: Eagle3Config, input_size: int | None = None):
        super().__init__()
        H = config.hidden_size
        d_in = input_size or 2 * H
        self.nh = self.nkv = config.num_attention_heads
        self.nope, self.rope, self.hd_v = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        hd_qk = self.nope + self.rope
        eps = config.rms_norm_eps
        self.q_a_proj = nn.Linear(d_in, config.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(config.q_lora_rank, eps=eps)
        self.q_b_proj = nn.Linear(config.q_lora_rank, self.nh * hd_qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d_in, self.kv_lora_rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, eps=eps)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, self.nh * (self.nope + self.hd_v), bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd_v, H, bias=False)
        self.scaling = hd_qk ** -0.5 * deepseek_rope(config)[2]
        self.sliding_window = None

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """``x (B, T, 2H)``, RoPE ``cos`` / ``sin (B, T, r)`` -> q, k and v, each ``(B, nh, T, hd_qk)``:
        v is the ``hd_v`` values zero-padded to ``hd_qk`` (:func:`pad_values`)."""
        B, T, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(B, T, self.nh, -1).transpose(1, 2).split([self.nope, self.rope], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(B, T, self.nh, -1).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.hd_v], dim=-1)
        k_pe = apply_interleaved_rope(k_pe.unsqueeze(1), cos, sin)  # (B, 1, T, r): one for all heads
        q = torch.cat([q_nope, apply_interleaved_rope(q_pe, cos, sin)], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(B, self.nh, T, self.rope)], dim=-1)
        return q, k, pad_values(v, self.nope + self.rope)

    def _out(self, attn: torch.Tensor) -> torch.Tensor:
        """``(B, nh, T, hd_qk)`` attention over the padded values -> their first ``hd_v`` channels
        (the rest are the zero padding's) -> ``o_proj`` ``(B, T, H)``."""
        return super()._out(attn[..., : self.hd_v])

    def target_tensors(self, hidden_size: int) -> dict[str, torch.Tensor]:
        """:meth:`~draftsmith.models.eagle3.attention.Eagle3Attention.target_tensors` of the MLA
        layer: the projections reading the layer input (``q_a_proj``, ``kv_a_proj_with_mqa``) take the
        target's into their ``g`` columns ``[:, H:]``; the latent norms, ``q_b_proj``, ``kv_b_proj`` and
        ``o_proj`` are copied whole."""
        H = hidden_size
        return {
            "self_attn.q_a_proj.weight": self.q_a_proj.weight[:, H:],
            "self_attn.q_a_layernorm.weight": self.q_a_layernorm.weight,
            "self_attn.q_b_proj.weight": self.q_b_proj.weight,
            "self_attn.kv_a_proj_with_mqa.weight": self.kv_a_proj_with_mqa.weight[:, H:],
            "self_attn.kv_a_layernorm.weight": self.kv_a_layernorm.weight,
            "self_attn.kv_b_proj.weight": self.kv_b_proj.weight,
            "self_attn.o_proj.weight": self.o_proj.weight,
        }
