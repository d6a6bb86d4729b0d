"""The step-cost table estimated from datasheet figures: ``draftsmith plan --roofline GPU``.

A labelled fallback for when the serving machine cannot be measured (the GPU is not rented yet,
or the plan is for another machine than this one). It writes the same :class:`CostTable` as
:mod:`draftsmith.eval.serving_costs`, with ``source`` starting ``roofline (estimate)``, so the
plan says what its step costs came from.

One decode step at batch ``b`` and ``K`` draft tokens (docs/serving_plan.md):

- **target verification** of ``n = b (K + 1)`` positions: the larger of the bytes it reads over
  the HBM bandwidth and its matmul FLOPs over the bf16 peak, both over ``tensor_parallel_size``
  GPUs. Bytes: every weight but the input embedding (a lookup of ``n`` rows; it counts when it is
  tied to the ``lm_head``), the routed experts only as far as ``n`` tokens touch them (``E (1 -
  (1 - k / E)^n)`` of ``E`` per layer, routing taken as uniform), and each sequence's KV cache
  over ``context_tokens`` (a sliding layer's over at most its window; a linear-attention layer's
  state). FLOPs: ``2 x`` the active parameters (less the input embedding) per position, plus
  ``4 x context x heads x head_dim`` per position and attention layer.
- **drafting**: a chain drafter (EAGLE-3, MTP, the MLP speculator, Medusa's heads) runs ``K``
  steps of ``b`` positions, each reading the draft's weights once; a block drafter (DFlash,
  DSpark, P-EAGLE) one pass of ``b K`` positions; ngram's prompt lookup costs nothing here.

It is a lower bound: no kernel-launch, scheduling, sampling or communication time, perfect
overlap, routing spread evenly. At batch 1 vLLM's own step on a GPU is several times it; use it
for the shape of the curve (where speculation stops paying), and measure before serving.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from ..hardware import ROOFLINE_GPUS, Gpu
from ..target.facts import target_facts, text_json
from ..target.families import experts_per_token, layer_types, num_experts
from .serving_plan import CostTable, PlanError, StepCost

ATTENTION_KINDS = ("full_attention", "sliding_attention", "mla")


def gpu_named(name: str) -> Gpu:
    """Raises:
        PlanError: a GPU with no datasheet figures here (the known ones named)."""
    try:
        return ROOFLINE_GPUS[name.lower()]
    except KeyError:
        raise PlanError(f"--roofline {name}: no datasheet figures for it; known: {', '.join(sorted(ROOFLINE_GPUS))}") from None


def experts_touched(tokens: float, experts: int, per_token: int) -> float:
    """Expected distinct routed experts of one layer that ``tokens`` tokens pick, each choosing
    ``per_token`` of ``experts`` uniformly: ``E (1 - (1 - k / E)^n)``."""
    if not experts or not per_token:
        return 0.0
    return experts * (1.0 - (1.0 - per_token / experts) ** tokens)


def draft_size(draft: Path | None) -> tuple[int, int]:
    """``(parameters, bytes at bf16)`` of the draft's ``*.safetensors`` in ``draft`` (read from
    the headers; ``(0, 0)`` for ``None``: ngram)."""
    if draft is None:
        return 0, 0
    from safetensors import safe_open

    params = 0
    for path in sorted(Path(draft).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as fh:
            for key in fh.keys():
                n = 1
                for d in fh.get_slice(key).get_shape():
                    n *= int(d)
                params += n
    return params, 2 * params


class TargetRoofline:
    """The target's verification step as a function of positions and sequences (module docstring)."""

    def __init__(self, config_json: dict[str, Any], gpu: Gpu, *, dtype: str = "bfloat16",
                 tensor_parallel_size: int = 1, context_tokens: int = 512):
        t = text_json(config_json)
        facts = target_facts(config_json, dtype)
        parts, counts = facts["bytes_by_part"], facts["counts"]
        untied = "lm_head" in parts
        self.gpu, self.tp, self.context = gpu, max(1, tensor_parallel_size), context_tokens
        self.experts, self.per_token = num_experts(t), experts_per_token(t)
        self.expert_bytes = parts.get("experts", 0)
        self.dense_bytes = facts["bytes"] - self.expert_bytes - (parts.get("embedding", 0) if untied else 0)
        self.active_params = facts["active_parameters"] - (counts.get("embedding", 0) if untied else 0)
        window = facts["sliding_window"] or context_tokens
        self.kv_bytes_per_seq = (context_tokens * facts["kv_bytes_per_token"]
                                 + min(context_tokens, window) * facts["sliding_kv_bytes_per_token"]
                                 + facts["state_bytes_per_sequence"])
        heads = int(t["num_attention_heads"])
        head_dim = int(t.get("head_dim") or int(t["hidden_size"]) // heads)
        kinds = layer_types(t)
        self.attn_flops_per_pos = sum(4 * (min(context_tokens, window) if k == "sliding_attention" else context_tokens)
                                      * heads * head_dim for k in kinds if k in ATTENTION_KINDS)

    def seconds(self, positions: int, sequences: int) -> float:
        touched = experts_touched(positions, self.experts, self.per_token)
        weights = self.dense_bytes + (self.expert_bytes * touched / self.experts if self.experts else self.expert_bytes)
        read = weights + sequences * self.kv_bytes_per_seq
        flops = positions * (2 * self.active_params + self.attn_flops_per_pos)
        return max(read / (self.gpu.hbm_tbps * 1e12), flops / (self.gpu.bf16_tflops * 1e12)) / self.tp


def draft_seconds(params: int, nbytes: int, gpu: Gpu, batch: int, k: int, chain: bool) -> float:
    """The ``K`` draft tokens of ``batch`` sequences: ``K`` steps of ``batch`` positions (a chain
    drafter) or one pass of ``batch K`` (a block drafter); each pass reads the weights once."""
    if k == 0 or params == 0:
        return 0.0
    one = lambda positions: max(nbytes / (gpu.hbm_tbps * 1e12), 2 * params * positions / (gpu.bf16_tflops * 1e12))  # noqa: E731
    return k * one(batch) if chain else one(batch * k)


def roofline_costs(config_json: dict[str, Any], gpu: Gpu, ks: Sequence[int], batch_sizes: Sequence[int], *,
                   draft: Path | None, chain: bool, context_tokens: int, dtype: str = "bfloat16",
                   tensor_parallel_size: int = 1, target: str, method: str | None) -> CostTable:
    """The cost table of the target (``config_json``: its ``config.json``) and the draft in
    ``draft`` (None: ngram) on ``gpu``, estimated (module docstring).

    Raises:
        KeyError: the target's config misses a key its family needs (its name).
    """
    roof = TargetRoofline(config_json, gpu, dtype=dtype, tensor_parallel_size=tensor_parallel_size,
                          context_tokens=context_tokens)
    params, nbytes = draft_size(draft)
    costs = [StepCost(batch_size=b, k=k, step_s=roof.seconds(b * (k + 1), b) + draft_seconds(params, nbytes, gpu, b, k, chain))
             for k in sorted(set(ks)) for b in sorted(set(batch_sizes))]
    return CostTable(source=f"roofline (estimate, a lower bound): {gpu.name} datasheet, bf16 {gpu.bf16_tflops:g} TFLOP/s, "
                            f"HBM {gpu.hbm_tbps:g} TB/s, TP {tensor_parallel_size}, {context_tokens}-token context; "
                            "no launch, scheduling or sampling time",
                     machine={"gpu": gpu.name, "roofline": True, "tensor_parallel_size": tensor_parallel_size},
                     target=target, draft=str(draft) if draft else method, method=method, engine_version=None,
                     prompt_tokens=context_tokens, output_tokens=None, costs=costs)
