"""A fused draft-vocab loss: lm_head matmul, divergence, accuracy and gradients without ``(M, V)`` tensors.

:func:`fused_linear_distill` computes what :func:`~draftsmith.train.losses.chunked_distill` computes
for ``logits_fn = lambda h: F.linear(h, weight)`` on already-normed rows, following the design of
Liger-Kernel's fused linear cross-entropy: per chunk of rows the logits come from one cuBLAS matmul
in the rows' dtype, one Triton kernel (:func:`_distill_rows_kernel`, one program per row, looping
over the vocab in ``BLOCK_V`` tiles) reads them with the target logits and writes the row's loss,
argmax hit (and, for ``draft.accept_weighting: soft``, the expected acceptance ``sum min(p_T, q_T)``
at the served temperature, from the same passes; for ``draft.opd`` also ``KL(q || p)`` at a second
row weight, :func:`_distill_rows_kernel`'s ``REVERSE``) and ``weight * dD/dlogits`` over the logits
buffer, and two more matmuls turn that into the gradients of the rows and of the weight. The gradients are therefore computed in forward;
backward only scales them by the incoming gradient. docs/fused_loss.md has the formulas.

:func:`fused_loss_available` says whether the fused path applies (CUDA, Triton, a supported dtype
and loss); the caller falls back to the chunked torch path otherwise. The kernel also runs on CPU
tensors when Triton was imported under its interpreter (``TRITON_INTERPRET=1`` before the first
``import triton``, :func:`interpreted`): the tests do that in a subprocess.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from . import losses
from .losses import _ALPHA_FLOOR, AcceptSpec, DistillOut, LossSpec, group_reach

try:
    import triton
    import triton.language as tl
except ImportError as e:  # the fused path is then unavailable; the module still imports
    triton = tl = None
    _TRITON_ERROR = f"{type(e).__name__}: {e}"
else:
    _TRITON_ERROR = ""

KINDS: dict[str, int] = {"forward_kl": 0, "reverse_kl": 1, "jsd": 2, "tv": 3, "lk_alpha": 4, "lk_lambda": 5}
_LABELS = 6  # hard labels: cross-entropy against token ids
DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # of the draft rows and weight
DEFAULT_CHUNK_BYTES = 256 << 20  # one (C, V) logits buffer in the rows' dtype
MAX_BLOCK_V = 4096  # vocab tile of the row kernel (the tests lower it to get several tiles)


def fused_chunk_rows(vocab_size: int, dtype: torch.dtype, chunk_rows: int | None = None) -> int:
    """Rows per chunk of :func:`fused_linear_distill`: ``chunk_rows``, or as many as keep one
    ``(C, vocab_size)`` buffer of ``dtype`` at :data:`DEFAULT_CHUNK_BYTES` (256 MiB: 4194 rows at
    V = 32000 in bf16, 1046 at V = 128256; half as many in fp32)."""
    return max(1, chunk_rows or DEFAULT_CHUNK_BYTES // (dtype.itemsize * max(1, vocab_size)))


def fused_loss_available(device: torch.device | str, dtype: torch.dtype, spec: LossSpec | None = None,
                         labels: bool = False) -> tuple[bool, str]:
    """Whether :func:`fused_linear_distill` applies to draft rows on ``device`` in ``dtype``.

    Reads no tensor (no device work). ``spec`` None: forward KL; ignored with ``labels``.

    Returns:
        ``(True, "")``, or ``(False, reason)`` where reason is one line: not a CUDA device, Triton
        not importable, a dtype other than bf16 / fp16 / fp32, or a loss kind it does not know.
    """
    device = torch.device(device)
    if not losses.fused_device_ok(device):  # CUDA (a benchmark's fake GPU step patches it)
        return False, f"the fused loss needs a CUDA device, got {device.type}"
    if triton is None:
        return False, f"triton is not importable ({_TRITON_ERROR})"
    return fused_kernel_covers(dtype, spec, labels)


def fused_kernel_covers(dtype: torch.dtype, spec: LossSpec | None = None, labels: bool = False) -> tuple[bool, str]:
    """The part of :func:`fused_loss_available` that does not depend on this process (its device
    and Triton): the row dtype and the loss kind the kernel covers. ``(True, "")`` or ``(False, reason)``."""
    if dtype not in DTYPES:
        return False, f"the fused loss supports bf16 / fp16 / fp32 rows, got {dtype}"
    kind = (spec or LossSpec()).kind
    if not labels and kind not in KINDS:
        return False, f"the fused loss has no kernel for loss {kind!r} (it has {', '.join(KINDS)})"
    return True, ""


# --------------------------------------------------------------------------------------
# The row kernel: a plain function, jit-ed on first use (_kernel) in the mode Triton was imported in.


def _distill_rows_kernel(s_ptr, s_stride, t_ptr, t_stride, idx_ptr, w_ptr, loss_ptr, hit_ptr, acc_ptr, wr_ptr,
                         rev_ptr, V, temperature, kl_scale, kl_decay, alpha_floor, accept_s, accept_t,
                         KIND: tl.constexpr, WRITE_GRAD: tl.constexpr, SOFT: tl.constexpr, REVERSE: tl.constexpr,
                         BLOCK_V: tl.constexpr):
    """Row ``r``: draft logits ``s = s_ptr[r, :V]``, target logits ``t = t_ptr[idx[r], :V] / temperature``
    (KIND 6: the label ``t_ptr[idx[r]]``), weight ``w_ptr[r]``. Writes ``loss_ptr[r] = D`` (fp32,
    nats), ``hit_ptr[r] = argmax s == argmax t`` (first index on ties) and, with WRITE_GRAD,
    ``w * dD/ds`` over ``s`` in place. KIND: 0 forward_kl, 1 reverse_kl, 2 jsd, 3 tv, 4 lk_alpha,
    5 lk_lambda, 6 hard labels. With SOFT (not KIND 6) also ``acc_ptr[r] = sum min(p_a, q_a)``, the
    expected acceptance at the served temperature Ta: ``q_a = softmax(s * accept_s)``,
    ``p_a = softmax(t * accept_t)`` (``accept_s = 1 / Ta``, ``accept_t = temperature / Ta``: the
    target's raw logits over Ta), its log-normalisers kept in pass 1 beside the others.

    With REVERSE (``draft.opd``'s rejected term; not KIND 6) the row also carries ``KL(q || p)``
    with its own weight ``w_r = wr_ptr[r]``: pass 2 sums it beside D (KIND 1's D is that sum),
    ``rev_ptr[r] = KL(q || p)`` is written, and the gradient becomes
    ``w * dD/ds + w_r * q (log q - log p - KL(q || p))``, written in pass 3 for every kind (forward
    KL's pass-2 write waits for the row sum). Without REVERSE the kernel is the same as before."""
    row = tl.program_id(0).to(tl.int64)
    s_row = s_ptr + row * s_stride
    t_row = t_ptr + tl.load(idx_ptr + row).to(tl.int64) * t_stride
    w = tl.load(w_ptr + row).to(tl.float32)
    cols = tl.arange(0, BLOCK_V)

    # pass 1: online max / sum of exp (lse) and first-index argmax of s and of t / T
    m_s = -float("inf")
    d_s = 0.0
    a_s = 0
    m_t = -float("inf")
    d_t = 0.0
    a_t = 0
    d_sa = 0.0  # SOFT: the sums of exp at the served temperature (same maxima, scaled)
    d_ta = 0.0
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + cols
        mask = offs < V
        s = tl.load(s_row + offs, mask=mask, other=-float("inf")).to(tl.float32)
        top, arg = tl.max(s, 0, return_indices=True)  # the first index of the tile's max
        a_s = tl.where(top > m_s, arg + v0, a_s)  # strictly greater: earlier tiles win ties
        m_new = tl.maximum(m_s, top)
        d_s = d_s * tl.exp(m_s - m_new) + tl.sum(tl.exp(s - m_new), 0)
        if SOFT:
            d_sa = d_sa * tl.exp((m_s - m_new) * accept_s) + tl.sum(tl.exp((s - m_new) * accept_s), 0)
        m_s = m_new
        if KIND != 6:
            t = tl.load(t_row + offs, mask=mask, other=-float("inf")).to(tl.float32) / temperature
            top, arg = tl.max(t, 0, return_indices=True)
            a_t = tl.where(top > m_t, arg + v0, a_t)
            m_new = tl.maximum(m_t, top)
            d_t = d_t * tl.exp(m_t - m_new) + tl.sum(tl.exp(t - m_new), 0)
            if SOFT:
                d_ta = d_ta * tl.exp((m_t - m_new) * accept_t) + tl.sum(tl.exp((t - m_new) * accept_t), 0)
            m_t = m_new
    lse_s = m_s + tl.log(d_s)

    if KIND == 6:  # cross-entropy: D = lse(s) - s[y], grad q - onehot(y); a label outside [0, V) is ignored
        label = tl.load(t_row)
        valid = (label >= 0) & (label < V)
        s_label = tl.load(s_row + label, mask=valid, other=0.0).to(tl.float32)
        tl.store(loss_ptr + row, tl.where(valid, lse_s - s_label, 0.0))
        tl.store(hit_ptr + row, (valid & (a_s == label)).to(tl.float32))
        if WRITE_GRAD:
            scale = tl.where(valid, w, 0.0)
            for v0 in range(0, V, BLOCK_V):
                offs = v0 + cols
                mask = offs < V
                s = tl.load(s_row + offs, mask=mask, other=0.0).to(tl.float32)
                g = tl.exp(s - lse_s) - tl.where(offs == label, 1.0, 0.0)
                tl.store(s_row + offs, (g * scale).to(s_ptr.dtype.element_ty), mask=mask)
    else:
        lse_t = m_t + tl.log(d_t)
        lse_sa = 0.0
        lse_ta = 0.0
        if SOFT:
            lse_sa = m_s * accept_s + tl.log(d_sa)
            lse_ta = m_t * accept_t + tl.log(d_ta)
        # pass 2: the row sums. acc0: D (kl / jsd) or alpha = sum min(p, q) (tv, lk_*);
        # acc1: sum q * g (jsd) or sum q * I (tv, lk_*); acc2: KL(p || q) (lk_lambda);
        # acc3 (SOFT): sum min(p_a, q_a) at the served temperature; acc4 (REVERSE): KL(q || p)
        acc0 = 0.0
        acc1 = 0.0
        acc2 = 0.0
        acc3 = 0.0
        acc4 = 0.0
        for v0 in range(0, V, BLOCK_V):
            offs = v0 + cols
            mask = offs < V
            s = tl.load(s_row + offs, mask=mask, other=0.0).to(tl.float32)
            t = tl.load(t_row + offs, mask=mask, other=0.0).to(tl.float32) / temperature
            log_q = s - lse_s
            log_p = t - lse_t
            q = tl.where(mask, tl.exp(log_q), 0.0)
            p = tl.where(mask, tl.exp(log_p), 0.0)
            if SOFT:
                q_a = tl.where(mask, tl.exp(s * accept_s - lse_sa), 0.0)
                p_a = tl.where(mask, tl.exp(t * accept_t - lse_ta), 0.0)
                acc3 += tl.sum(tl.minimum(p_a, q_a), 0)
            if REVERSE and KIND != 1:
                acc4 += tl.sum(q * (log_q - log_p), 0)
            if KIND == 0:
                acc0 += tl.sum(p * (log_p - log_q), 0)
                if WRITE_GRAD and not REVERSE:  # dKL(p||q)/ds = q - p: written here, no third pass
                    tl.store(s_row + offs, ((q - p) * w).to(s_ptr.dtype.element_ty), mask=mask)
            elif KIND == 1:
                acc0 += tl.sum(q * (log_q - log_p), 0)
            elif KIND == 2:
                hi = tl.maximum(log_p, log_q)
                log_m = hi + tl.log(1.0 + tl.exp(tl.minimum(log_p, log_q) - hi)) - 0.6931471805599453
                acc0 += tl.sum(0.5 * (p * (log_p - log_m) + q * (log_q - log_m)), 0)
                acc1 += tl.sum(q * (0.5 * (log_q - log_m)), 0)
            else:
                acc0 += tl.sum(tl.minimum(p, q), 0)
                ind = tl.where(q < p, 1.0, tl.where(q == p, 0.5, 0.0))  # d min(p, q)/dq, ties halved as torch
                acc1 += tl.sum(q * ind, 0)
                if KIND == 5:
                    acc2 += tl.sum(p * (log_p - log_q), 0)
        # the row loss and the scalars of its gradient
        c_alpha = 0.0  # lk_alpha: -1/alpha where alpha >= floor (clamp_min passes the gradient), else 0
        w_kl = 0.0  # lk_lambda: the detached KL weight
        if KIND <= 2:
            D = acc0
        elif KIND == 3:
            D = 1.0 - acc0
        elif KIND == 4:
            D = -tl.log(tl.maximum(acc0, alpha_floor))
            c_alpha = tl.where(acc0 >= alpha_floor, -1.0 / tl.maximum(acc0, alpha_floor), 0.0)
        else:
            w_kl = kl_scale * tl.exp(-kl_decay * acc0)
            D = w_kl * acc2 + (1.0 - acc0)
        R = 0.0  # REVERSE: KL(q || p) and its weight
        w_r = 0.0
        if REVERSE:
            if KIND == 1:
                R = acc0
            else:
                R = acc4
            w_r = tl.load(wr_ptr + row).to(tl.float32)
            tl.store(rev_ptr + row, R)
        tl.store(loss_ptr + row, D)
        tl.store(hit_ptr + row, (a_s == a_t).to(tl.float32))
        if SOFT:
            tl.store(acc_ptr + row, acc3)
        if WRITE_GRAD and (KIND != 0 or REVERSE):  # pass 3: w * dD/ds, dalpha/ds = q (I - sum q I)
            for v0 in range(0, V, BLOCK_V):
                offs = v0 + cols
                mask = offs < V
                s = tl.load(s_row + offs, mask=mask, other=0.0).to(tl.float32)
                t = tl.load(t_row + offs, mask=mask, other=0.0).to(tl.float32) / temperature
                log_q = s - lse_s
                log_p = t - lse_t
                q = tl.exp(log_q)
                p = tl.exp(log_p)
                if KIND == 0:
                    g = q - p
                elif KIND == 1:
                    g = q * (log_q - log_p - D)
                elif KIND == 2:
                    hi = tl.maximum(log_p, log_q)
                    log_m = hi + tl.log(1.0 + tl.exp(tl.minimum(log_p, log_q) - hi)) - 0.6931471805599453
                    g = q * (0.5 * (log_q - log_m) - acc1)
                else:
                    ind = tl.where(q < p, 1.0, tl.where(q == p, 0.5, 0.0))
                    d_alpha = q * (ind - acc1)
                    if KIND == 3:
                        g = -d_alpha
                    elif KIND == 4:
                        g = c_alpha * d_alpha
                    else:
                        g = w_kl * (q - p) - d_alpha
                g = g * w
                if REVERSE:
                    g += w_r * q * (log_q - log_p - R)
                tl.store(s_row + offs, g.to(s_ptr.dtype.element_ty), mask=mask)


_KERNELS: dict[bool, Any] = {}


def interpreted() -> bool:
    """Whether Triton was imported under its interpreter (``TRITON_INTERPRET=1`` before the first
    ``import triton``): its language functions (``tl.sum``, ``tl.argmax``) are then interpreted and
    kernels run on CPU tensors (CUDA tensors are copied to the host and back), never compiled."""
    return triton is not None and not isinstance(tl.sum, triton.runtime.JITFunction)


def _kernel() -> Any:
    """The row kernel, ``triton.jit``-ed on first use in the mode Triton's language was imported in
    (``TRITON_INTERPRET`` is read when a function is decorated, and may have changed since)."""
    mode = interpreted()
    if mode not in _KERNELS:
        with triton.knobs.runtime.scope():
            triton.knobs.runtime.interpret = mode
            _KERNELS[mode] = triton.jit(_distill_rows_kernel)
    return _KERNELS[mode]


def _launch_kernel(logits: torch.Tensor, teacher: torch.Tensor, teacher_index: torch.Tensor,
                   row_weight: torch.Tensor, row_loss: torch.Tensor, row_hit: torch.Tensor, spec: LossSpec,
                   labels: bool, write_grad: bool, block_v: int | None = None, row_alpha: torch.Tensor | None = None,
                   accept_temperature: float = 0.0, rejected_weight: torch.Tensor | None = None,
                   row_rejected: torch.Tensor | None = None) -> None:
    """Run the row kernel on C rows: ``row_loss`` / ``row_hit`` ``(C,)`` fp32 are written, and with
    ``write_grad`` ``logits (C, V)`` is overwritten by ``row_weight * dD/dlogits`` (its dtype).
    With ``row_alpha`` ``(C,)`` fp32 (not with ``labels``; ``accept_temperature`` > 0) the rows'
    expected acceptance ``sum min(p_T, q_T)`` at that temperature is written there too. With
    ``rejected_weight`` and ``row_rejected`` ``(C,)`` fp32 (both or neither; not with ``labels``)
    each row also carries ``rejected_weight * KL(q || p)``: ``KL(q || p)`` is written to
    ``row_rejected`` and its weighted gradient added to the logits' (``draft.opd``).

    ``teacher`` is ``(N, V)`` target logits (any float dtype) or with ``labels`` ``(N,)`` ids;
    ``teacher_index (C,)`` int, ``row_weight (C,)`` fp32; every tensor's last dim contiguous. CUDA
    tensors run the compiled kernel, or the interpreter when Triton was imported under it (then CPU
    tensors too). ``block_v``: the vocab tile (default ``min(MAX_BLOCK_V, next_pow2(V))``).

    Raises:
        RuntimeError: Triton is not importable, or CPU tensors without Triton's interpreter.
        ValueError: a soft acceptance without a temperature > 0; ``rejected_weight`` without
            ``row_rejected`` (or the reverse), or with ``labels``.
    """
    if triton is None:
        raise RuntimeError(f"the fused loss needs triton ({_TRITON_ERROR})")
    reverse = rejected_weight is not None
    if reverse != (row_rejected is not None) or (reverse and labels):
        raise ValueError("the rejected term needs both rejected_weight and row_rejected, and a target distribution "
                         "(not labels)")
    C, V = logits.shape
    if C == 0:
        return
    block = block_v or min(MAX_BLOCK_V, triton.next_power_of_2(V))
    kind = _LABELS if labels else KINDS[spec.kind]
    if logits.device.type != "cuda" and not interpreted():
        raise RuntimeError(f"the fused loss runs {logits.device.type} tensors only under Triton's interpreter: set "
                           "TRITON_INTERPRET=1 before triton is first imported")
    soft = row_alpha is not None and not labels
    if soft and not accept_temperature > 0:
        raise ValueError(f"the expected acceptance needs a temperature > 0, got {accept_temperature}")
    accept_s = 1.0 / accept_temperature if soft else 1.0
    _kernel()[(C,)](
        logits, logits.stride(0), teacher, teacher.stride(0), teacher_index, row_weight, row_loss, row_hit,
        row_alpha if soft else row_loss, rejected_weight if reverse else row_weight,
        row_rejected if reverse else row_loss, V, float(spec.target_temperature), float(spec.lk_kl_scale),
        float(spec.lk_kl_decay), _ALPHA_FLOOR, accept_s, float(spec.target_temperature) * accept_s,
        KIND=kind, WRITE_GRAD=write_grad, SOFT=soft, REVERSE=reverse, BLOCK_V=block,
        num_warps=max(4, min(16, block // 256)))


@torch.library.custom_op("draftsmith::distill_rows",
                         mutates_args=("logits", "row_loss", "row_hit", "row_alpha", "row_rejected"))
def distill_rows(logits: torch.Tensor, teacher: torch.Tensor, teacher_index: torch.Tensor, row_weight: torch.Tensor,
                 row_loss: torch.Tensor, row_hit: torch.Tensor, row_alpha: torch.Tensor | None,
                 rejected_weight: torch.Tensor | None, row_rejected: torch.Tensor | None, kind: str,
                 temperature: float, lk_kl_scale: float, lk_kl_decay: float, labels: bool, write_grad: bool,
                 accept_temperature: float) -> None:
    """The row kernel (:func:`_launch_kernel`) as one torch operator, ``draftsmith::distill_rows``:
    opaque to ``torch.compile``, seen as one op by dispatch modes (``draftsmith bench step`` counts
    it as one kernel with its inputs and outputs), and shape-only under ``FakeTensorMode`` (its
    fake implementation writes nothing), so ``bench memory`` and ``bench step`` run the fused path
    on a CPU. ``row_alpha``: None, or where the rows' expected acceptance at ``accept_temperature``
    goes (``draft.accept_weighting: soft``). ``rejected_weight`` / ``row_rejected``: None, or the
    rows' reverse-KL weight and where their ``KL(q || p)`` goes (``draft.opd``)."""
    _launch_kernel(logits, teacher, teacher_index, row_weight, row_loss, row_hit,
                   LossSpec(kind, lk_kl_scale, lk_kl_decay, temperature), labels, write_grad,
                   row_alpha=row_alpha, accept_temperature=accept_temperature, rejected_weight=rejected_weight,
                   row_rejected=row_rejected)


@distill_rows.register_fake
def _distill_rows_fake(logits, teacher, teacher_index, row_weight, row_loss, row_hit, row_alpha, rejected_weight,
                       row_rejected, kind, temperature, lk_kl_scale, lk_kl_decay, labels, write_grad,
                       accept_temperature) -> None:
    return None


# --------------------------------------------------------------------------------------
# The fused linear + divergence


class _FusedLinearDistill(torch.autograd.Function):
    """Forward computes the loss and, when asked, the gradients (kept on ``ctx``, not saved tensors:
    an enclosing activation checkpoint neither drops nor recomputes them); backward scales them."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, teacher: torch.Tensor, teacher_index: torch.Tensor,
                row_weight: torch.Tensor, rejected_weight: torch.Tensor | None, row_rejected: torch.Tensor | None,
                spec: LossSpec, labels: bool, rows: int, need_x: bool, need_w: bool,
                accept: AcceptSpec | None) -> tuple[torch.Tensor, ...]:
        M, H = x.shape
        V = weight.shape[0]
        grad = need_x or need_w
        row_loss = x.new_empty(M, dtype=torch.float32)
        row_hit = x.new_empty(M, dtype=torch.float32)
        # draft.accept_weighting: the kernel's expected acceptance (soft); a group's reach scales each
        # row's gradient after the kernel (its row of grad_x, its x row in grad_w: O(C * H), not O(C * V))
        soft, group = accept is not None and accept.soft, accept.group if accept is not None else 0
        row_alpha = x.new_empty(M, dtype=torch.float32) if soft else None
        reach = x.new_empty(M, dtype=torch.float32) if group else None
        untrained = row_weight <= 0 if group else None  # weight 0: no label, passes the chain on
        accept_temperature = float(accept.temperature) if soft else 0.0
        # draft.opd: KL(q || p) beside D in the same kernel, weighted rejected_weight, written to
        # row_rejected (an out buffer, not an output: backward makes no zero gradient for it); over
        # groups both weights need the chunk's reach first: w * reach and w * opd_gamma**j * (1 - reach)
        split = bool(group) and accept.opd
        if split:
            decayed = (row_weight.view(-1, group) * accept.slot_decay(x.device)).flatten()  # w * opd_gamma**j
            accepted_weight, rejected_weight = torch.empty_like(row_weight), torch.empty_like(row_weight)
        grad_x = torch.empty(M, H, dtype=x.dtype, device=x.device) if need_x else None
        single = M <= rows
        grad_w = None if single or not need_w else torch.zeros(V, H, dtype=torch.float32, device=x.device)
        buf = x.new_empty(min(rows, M), V)  # the one (C, V) logits / gradient buffer
        scalars = (spec.kind, float(spec.target_temperature), float(spec.lk_kl_scale), float(spec.lk_kl_decay), labels)
        for s in range(0, M, rows):
            e = min(s + rows, M)
            x_c, logits = x[s:e], buf[:e - s]
            torch.mm(x_c, weight.t(), out=logits)
            chunk = (row_loss[s:e], row_hit[s:e], None if row_alpha is None else row_alpha[s:e])
            if split:  # the chain's factors and both row losses first (no gradient: the weights do not matter),
                # then, once the reach gives the two weights, the gradient of both terms
                distill_rows(logits, teacher, teacher_index[s:e], row_weight[s:e], *chunk, decayed[s:e],
                             row_rejected[s:e], *scalars, False, accept_temperature)
                group_reach(row_alpha[s:e] if soft else row_hit[s:e], untrained[s:e], group, out=reach[s:e])
                torch.mul(row_weight[s:e], reach[s:e], out=accepted_weight[s:e])
                torch.addcmul(decayed[s:e], decayed[s:e], reach[s:e], value=-1.0, out=rejected_weight[s:e])
                if grad:
                    distill_rows(logits, teacher, teacher_index[s:e], accepted_weight[s:e], *chunk,
                                 rejected_weight[s:e], row_rejected[s:e], *scalars, True, accept_temperature)
            else:
                distill_rows(logits, teacher, teacher_index[s:e], row_weight[s:e], *chunk,
                             None if rejected_weight is None else rejected_weight[s:e],
                             None if row_rejected is None else row_rejected[s:e], *scalars, grad, accept_temperature)
                if group:
                    group_reach(row_alpha[s:e] if soft else row_hit[s:e], untrained[s:e], group, out=reach[s:e])
                    x_c = x_c * reach[s:e, None].to(x.dtype) if need_w else x_c
            if need_x:
                torch.mm(logits, weight, out=grad_x[s:e])
            if need_w:
                if single:
                    grad_w = logits.t() @ x_c
                elif weight.dtype == torch.float32:
                    grad_w.addmm_(logits.t(), x_c)
                else:  # fp32 accumulation over chunks of a bf16 / fp16 product
                    grad_w.add_(logits.t() @ x_c)
        if group and not split and need_x:  # each row's gradient times its reach, once for all chunks
            grad_x.mul_(reach[:, None].to(x.dtype))
        ctx.grads = (grad_x, None if grad_w is None else grad_w.to(weight.dtype))
        outs = (row_loss, row_hit, row_alpha, reach)
        ctx.mark_non_differentiable(*(t for t in outs if t is not None))
        total = (accepted_weight if split else (row_weight * reach) if group else row_weight) * row_loss
        if row_rejected is not None:  # sum(w_f * D + w_r * R): one reduction
            total = torch.addcmul(total, rejected_weight, row_rejected)
        return total.sum(), *outs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_loss: torch.Tensor, *_: Any) -> tuple[torch.Tensor | None, ...]:
        if ctx.grads is None:
            raise RuntimeError("fused_linear_distill: backward through the same call twice (its gradients are "
                               "freed by the first backward; retain_graph is not supported)")
        grad_x, grad_w = ctx.grads
        ctx.grads = None
        grad_x = None if grad_x is None else grad_x.mul_(grad_loss)
        grad_w = None if grad_w is None else grad_w.mul_(grad_loss)
        return grad_x, grad_w, None, None, None, None, None, None, None, None, None, None, None


def fused_linear_distill(x: torch.Tensor, weight: torch.Tensor, teacher: torch.Tensor, teacher_index: torch.Tensor,
                         row_weight: torch.Tensor, spec: LossSpec | None = None, labels: bool = False,
                         chunk_rows: int | None = None, accept: AcceptSpec | None = None,
                         rejected_weight: torch.Tensor | None = None) -> DistillOut:
    """``chunked_distill(x, lambda h: F.linear(h, weight), teacher, teacher_index, row_weight, spec,
    chunk_rows, labels, accept=accept, rejected_weight=rejected_weight)`` fused: per chunk of rows one
    matmul for the logits, the row kernel (loss, hit, ``dD/dlogits`` in place) and, when gradients
    are needed, two matmuls for the gradients of ``x`` and ``weight``. No ``(M, V)`` tensor exists;
    the largest is one ``(C, V)`` buffer.

    Gradients are computed in forward and scaled in backward, so the call must not be recomputed by
    activation checkpointing (it needs none: nothing ``(C, V)`` is kept); inside a checkpointed
    region its gradients are kept, not recomputed. One backward per call (no ``retain_graph``).
    Does not check the device (:func:`fused_loss_available` does): CPU tensors run when Triton was
    imported under its interpreter (the tests). Reads no tensor on the host.

    Under autocast (``x``'s device type) the matmuls run in the autocast dtype (``x`` and ``weight``
    cast to it, differentiably); otherwise in ``x``'s dtype.

    Args:
        x: ``(M, H)`` normed draft rows (bf16 / fp16 / fp32), usually with grad.
        weight: ``(V, H)`` the draft ``lm_head`` weight, same dtype as ``x``, with or without grad.
        teacher: ``(N, V)`` target logits over the draft vocab (bf16 / fp16 / fp32, read in place
            and computed in fp32; ``p = softmax(teacher / spec.target_temperature)``), or with
            ``labels`` ``(N,)`` int token ids (ids outside ``[0, V)``, e.g. -100, are ignored:
            loss, gradient and hit 0).
        teacher_index: ``(M,)`` int64, the ``teacher`` row of each row of ``x``.
        row_weight: ``(M,)`` float, the weight of each row's loss (0: not trained).
        spec: the divergence (:class:`~draftsmith.train.losses.LossSpec`); None: forward KL.
            Ignored with ``labels``.
        labels: ``teacher`` holds token ids: cross-entropy.
        chunk_rows: rows per chunk; default :func:`fused_chunk_rows` (one 256 MiB logits buffer).
        accept: ``draft.accept_weighting`` or ``draft.opd``
            (:class:`~draftsmith.train.losses.AcceptSpec`), as
            :func:`~draftsmith.train.losses.chunked_distill` takes it: soft at T > 0, the kernel also
            writes each row's expected acceptance (``row_alpha``); with a group, chunks hold whole
            groups and each row's loss and gradients are scaled by its group's reach (``row_reach``);
            ``draft.opd`` with a group also adds each row's ``KL(q || p)`` at weight ``row_weight *
            (1 - reach) * opd_gamma**j`` (slot j of its group) in the same kernel (``row_rejected``).
            Not with ``labels``.
        rejected_weight: ``(M,)`` float, ``draft.opd`` without a group (``accept.opd``): each row's
            weight of ``KL(q || p)``, computed in the same kernel pass as D (``row_rejected``).

    Returns:
        :class:`~draftsmith.train.losses.DistillOut`: ``loss_sum`` scalar fp32 ``sum_m w_m D_m`` (plus
        ``sum_m w_r,m KL_m(q || p)`` with ``draft.opd``; with grad to ``x`` / ``weight``), ``row_loss
        (M,)`` fp32 nats and ``row_hit (M,)`` fp32, both detached. M = 0: ``loss_sum`` is
        ``F.linear(x, weight).sum() * 0`` (a graph to both).

    Raises:
        ValueError: shapes, dtypes or devices that do not fit, an unknown ``spec.kind``, or a
            ``rejected_weight`` that is not ``draft.opd``'s (:func:`~draftsmith.train.losses.resolve_accept`).
        RuntimeError: Triton is not importable, or CPU tensors without Triton's interpreter.
    """
    spec = spec or LossSpec()
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x (M, H) and weight (V, H) expected, got {tuple(x.shape)} and {tuple(weight.shape)}")
    M, V = x.shape[0], weight.shape[0]
    if (teacher.dim() != 1) if labels else (teacher.dim() != 2 or teacher.shape[1] != V):
        want = "(N,) token ids" if labels else f"(N, {V}) logits"
        raise ValueError(f"teacher: {want} expected, got {tuple(teacher.shape)}")
    if tuple(teacher_index.shape) != (M,) or tuple(row_weight.shape) != (M,):
        raise ValueError(f"teacher_index and row_weight: ({M},) expected, got {tuple(teacher_index.shape)} and "
                         f"{tuple(row_weight.shape)}")
    if not labels and spec.kind not in KINDS:
        raise ValueError(f"unknown loss {spec.kind!r}: one of {', '.join(KINDS)}")
    devices = {t.device for t in (x, weight, teacher, teacher_index, row_weight)}
    if len(devices) != 1:
        raise ValueError(f"x, weight, teacher, teacher_index and row_weight on one device expected, got {devices}")
    kind = x.device.type
    if torch.is_autocast_enabled(kind):
        dtype = torch.get_autocast_dtype(kind)
        x, weight = x.to(dtype), weight.to(dtype)
    if x.dtype != weight.dtype or x.dtype not in DTYPES:
        raise ValueError(f"x and weight of one dtype among bf16 / fp16 / fp32 expected, got {x.dtype} and {weight.dtype}")
    accept = losses.resolve_accept(accept, rejected_weight, M, labels, "fused_linear_distill")
    soft, group = accept is not None and accept.soft, accept is not None and accept.group
    rejected = rejected_weight is not None or (group and accept.opd)
    if M == 0:  # the zero loss, whose graph reaches x and weight (DDP / FSDP see the weight used)
        empty = x.new_zeros(0, dtype=torch.float32)
        return DistillOut(F.linear(x, weight).float().sum() * 0.0, empty, empty, row_alpha=empty if soft else None,
                          row_reach=empty if group else None, row_rejected=empty if rejected else None)
    grad = torch.is_grad_enabled()
    need_x, need_w = grad and x.requires_grad, grad and weight.requires_grad
    if teacher.stride(-1) != 1:
        teacher = teacher.contiguous()
    rows = fused_chunk_rows(V, x.dtype, chunk_rows)
    if group:
        rows = max(accept.group, rows // accept.group * accept.group)
    if rejected_weight is not None:
        rejected_weight = rejected_weight.detach().float().contiguous()
    row_rejected = x.new_empty(M, dtype=torch.float32) if rejected else None
    with torch.autocast(kind, enabled=False):
        loss_sum, row_loss, row_hit, row_alpha, reach = _FusedLinearDistill.apply(
            x, weight, teacher, teacher_index.contiguous(), row_weight.float().contiguous(), rejected_weight,
            row_rejected, spec, labels, rows, need_x, need_w, accept)
    return DistillOut(loss_sum, row_loss, row_hit, row_alpha=row_alpha, row_reach=reach, row_rejected=row_rejected)


__all__ = ["DEFAULT_CHUNK_BYTES", "KINDS", "fused_chunk_rows", "fused_kernel_covers", "fused_linear_distill",
           "fused_loss_available", "interpreted"]
