"""Muon whose Newton-Schulz orthogonalisation runs in a chosen dtype, and the dtype a device runs fast.

torch's ``torch.optim.Muon`` always runs its 5 Newton-Schulz iterations in bf16
(``grad.bfloat16()`` in ``torch/optim/_muon.py``). Where the device has no fast bf16 matmul they
dominate the step: on a 2-core AMD EPYC with AVX2 and no AVX-512 one 576 x 1536
iteration takes 1,180 ms in bf16 and 54 ms in fp32, and the demo's EAGLE-3 step went from
seconds to 28 s. :class:`Muon` is torch's Muon (same constructor, parameter groups, state and
``state_dict`` keys: checkpoints move between the two) with ``ns_dtype``, the dtype of the
iterations; :func:`newton_schulz_dtype` picks bf16 where the device reports fast bf16 and fp32
elsewhere. In bf16 its update is torch's bit for bit; in fp32 it is torch's update with the
iterations in fp32.
"""

from __future__ import annotations

from typing import Any

import torch


def newton_schulz_dtype(device: torch.device | str) -> tuple[torch.dtype, str]:
    """``(dtype, why)``: bf16 where ``device`` has a fast bf16 matmul, as torch reports it, else fp32.

    - CUDA: ``torch.cuda.is_bf16_supported(including_emulation=False)`` (Ampere and later, ROCm);
    - CPU: native bf16 instructions in ``torch.cpu.get_capabilities()`` (x86 ``avx512_bf16`` /
      ``amx_bf16``; arm64 ``bf16`` / ``sve_bf16``) and torch's oneDNN bf16 matmul path usable
      (``torch.ops.mkldnn._is_mkldnn_bf16_supported()``); without them torch's bf16 matmul is its
      generic gemm, 20-50x slower than fp32 on an AVX2-only CPU;
    - anything else (MPS, XPU, no CUDA where a CUDA device was named): fp32, which is always correct.
    """
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            return torch.float32, "cuda: not available here"
        try:
            fast = torch.cuda.is_bf16_supported(including_emulation=False)
        except TypeError:  # an older torch without the argument
            fast = torch.cuda.is_bf16_supported()
        return (torch.bfloat16, "cuda: native bf16") if fast else (torch.float32, "cuda: no native bf16")
    if dev.type == "cpu":
        caps = _cpu_capabilities()
        native = [k for k in ("avx512_bf16", "amx_bf16", "bf16", "sve_bf16") if caps.get(k)]
        onednn = _onednn_bf16()
        if native and onednn:
            return torch.bfloat16, f"cpu: native bf16 ({', '.join(native)})"
        name = caps.get("cpu_name") or caps.get("architecture") or "this CPU"
        why = "no native bf16 (no avx512_bf16 / amx_bf16 / arm bf16)" if not native else "no oneDNN bf16 matmul"
        return torch.float32, f"cpu: {why} on {name}"
    return torch.float32, f"{dev.type}: fp32 (bf16 speed not detected)"


def _cpu_capabilities() -> dict[str, Any]:
    """torch's CPU feature flags: ``torch.cpu.get_capabilities()`` where this torch has it, else
    the x86 checks of older ones (``torch.cpu._is_avx512_bf16_supported``, ``_is_amx_tile_supported``:
    every CPU with AMX tiles has AMX-BF16)."""
    get = getattr(torch.cpu, "get_capabilities", None)
    if get is not None:
        return dict(get())
    caps: dict[str, Any] = {}
    for key, fn in (("avx512_bf16", "_is_avx512_bf16_supported"), ("amx_bf16", "_is_amx_tile_supported")):
        check = getattr(torch.cpu, fn, None)
        caps[key] = bool(check()) if check is not None else False
    return caps


def _onednn_bf16() -> bool:
    """torch's CPU bf16 matmul goes to oneDNN (mkldnn built, enabled, and the CPU passes its bf16
    check); True when torch has no such check to ask."""
    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return True


def zeropower_via_newtonschulz(grad: torch.Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int,
                               eps: float, dtype: torch.dtype) -> torch.Tensor:
    """torch's ``_zeropower_via_newtonschulz`` (the same operations in the same order) in
    ``dtype`` instead of bf16; ``grad`` is copied, never changed."""
    if ns_steps >= 100:
        raise ValueError("Number of steps must be less than 100 for computational efficiency")
    if grad.ndim != 2:
        raise ValueError("Input tensor gradient must be a 2D matrix")
    a, b, c = ns_coefficients
    x = grad.to(dtype, copy=True)
    if grad.size(0) > grad.size(1):
        x = x.T
    x.div_(x.norm().clamp(min=eps))  # spectral norm at most 1
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if grad.size(0) > grad.size(1) else x


if hasattr(torch.optim, "Muon"):  # torch >= 2.9
    from torch.optim._muon import _adjust_lr

    class Muon(torch.optim.Muon):
        """``torch.optim.Muon`` with its Newton-Schulz iterations in ``ns_dtype``.

        Args:
            params / lr / weight_decay / momentum / nesterov / ns_coefficients / eps / ns_steps /
                adjust_lr_fn: as ``torch.optim.Muon`` (same defaults).
            ns_dtype: the dtype of the iterations: ``torch.bfloat16`` (torch's), ``torch.float32``,
                or None: :func:`newton_schulz_dtype` of the first parameter's device. Not part of
                the parameter groups or ``state_dict`` (whose keys stay torch's); the update is
                added to the parameters in their dtype, as torch does.
        """

        def __init__(self, params: Any, *args: Any, ns_dtype: torch.dtype | None = None, **kwargs: Any):
            super().__init__(params, *args, **kwargs)
            if ns_dtype is None:
                first = next((p for g in self.param_groups for p in g["params"]), None)
                ns_dtype = newton_schulz_dtype(first.device if first is not None else "cpu")[0]
            self.ns_dtype = ns_dtype

        @torch.no_grad()
        def step(self, closure: Any = None) -> Any:
            """torch's ``Muon.step`` (``_single_tensor_muon``) with :func:`zeropower_via_newtonschulz`
            in ``ns_dtype``."""
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            for group in self.param_groups:
                params: list[torch.Tensor] = []
                grads: list[torch.Tensor] = []
                bufs: list[torch.Tensor] = []
                self._init_group(group, params, grads, bufs)
                lr, wd, momentum = group["lr"], group["weight_decay"], group["momentum"]
                if isinstance(lr, torch.Tensor) and lr.dim() != 0:
                    lr = lr.squeeze()
                for param, grad, buf in zip(params, grads, bufs):
                    if grad.ndim != 2:
                        raise ValueError("Param gradient must be a 2D matrix")
                    buf.lerp_(grad, 1 - momentum)
                    update = grad.lerp(buf, momentum) if group["nesterov"] else buf
                    update = zeropower_via_newtonschulz(update, group["ns_coefficients"], group["ns_steps"],
                                                        group["eps"], self.ns_dtype)
                    param.mul_(1 - lr * wd)
                    param.add_(update, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], param.shape))
            return loss
