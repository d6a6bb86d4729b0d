"""The fused draft-vocab loss (train/fused_loss.py) against the chunked torch path of losses.py.

How the Triton kernel runs on the CPU: Triton's interpreter has to be on when ``triton.language``
is first imported (``tl.sum`` / ``tl.argmax`` are ``@jit`` functions made at that import, compiled
or interpreted for good), and triton is already imported by then here: ``draftsmith.train.losses``
imports it (through transformers), and pytest imports it while collecting other test modules.
Setting ``TRITON_INTERPRET`` at the top of this module would therefore only work when the file runs
alone. So the fixture ``interpreted`` runs this file once as a script in a subprocess started with
``TRITON_INTERPRET=1`` (:func:`_worker`): it computes every case (the fused path under the
interpreter, the torch reference beside it) and saves the tensors; the tests assert on them. The
checks that run no kernel (M = 0, argument errors, availability) run in this process.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from typing import Any, Iterator

import pytest
import torch
import torch.nn.functional as F

from draftsmith.train import fused_loss as fl
from draftsmith.train.losses import AcceptSpec, LossSpec, chunked_distill, expected_acceptance

COMPILED = pytest.mark.skipif(fl.triton is None or fl.interpreted(), reason="needs triton imported without its interpreter")
M, H, V, N, CHUNK = 8, 16, 70, 5, 3  # 3 chunks of rows (3, 3, 2)
BLOCK, KERNEL_BLOCK = 64, 32  # vocab tiles: (64, 6) in the fused calls, (32, 32, 6) in the kernel's own cases
KINDS = list(fl.KINDS)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
CASES = ([f"{k}-{d}-T{t}" for k in KINDS for d in DTYPES for t in (1.0, 0.7)]
         + [f"labels-{d}-T1.0" for d in DTYPES] + ["autocast-bfloat16-T1.0"])
KERNEL_ROWS, KERNEL_V = 6, 70
KERNEL_CASES = [f"{k}-T{t}" for k in KINDS for t in (1.0, 0.7)]
# draft.accept_weighting: the kernel's expected acceptance at a served temperature (0.6) beside each
# kind's own passes; fused_linear_distill against the torch path with it (soft) and with groups of
# rows (a block drafter's slots); EAGLE-3's TTT loss and P-EAGLE's step end to end, fused against chunked
SOFT_KERNEL_CASES = [f"{k}-T0.7" for k in KINDS]
ACCEPT = {"soft": AcceptSpec("soft", 0.6), "hard-group": AcceptSpec("hard", 0.0, 2),
          "soft-group": AcceptSpec("soft", 0.6, 4)}
ACCEPT_CASES = [f"{a}-{d}" for a in ACCEPT for d in DTYPES]
TTT_ACCEPT_CASES = ["hard", "soft", "opd-hard", "opd-soft"]  # opd: draft.opd's split, both terms in one fused call
PEAGLE_ACCEPT_CASES = TTT_ACCEPT_CASES  # P-EAGLE's step: one fused call per depth, its rows weighted by their chains' reach
OPD_GROUP_CASES = [f"{m}-{d}" for m in ("hard", "soft") for d in DTYPES]  # draft.opd over a block drafter's slots
# draft.opd: the kernel's REVERSE (KL(q || p) at its own row weight beside every kind's D), and
# fused_linear_distill with rejected_weight (EAGLE-3's step) against the torch path, D = forward KL and jsd
OPD_KERNEL_CASES = [f"{k}-T0.7" for k in KINDS] + ["forward_kl-T1.0"]
OPD_CASES = [f"{m}-{k}-{d}" for m in ("hard", "soft") for k in ("forward_kl", "jsd") for d in DTYPES]
OPD_REACH = [1.0, 0.0, 0.3, 1.0, 0.0, 0.0, 1.0, 0.6]  # per row of _inputs (row 4 has weight 0): 0, 1 and between


# --------------------------------------------------------------------------------------
# the subprocess (TRITON_INTERPRET=1): every tensor the tests compare


def _inputs(case: str, seed: int = 0) -> tuple[Any, ...]:
    kind, dtype, temp = case.split("-")
    g = torch.Generator().manual_seed(seed)
    dt = DTYPES[dtype]
    labels = kind == "labels"
    spec = LossSpec("forward_kl" if kind in ("labels", "autocast") else kind, lk_kl_scale=1.5, lk_kl_decay=2.0,
                    target_temperature=float(temp[1:]))
    x = torch.randn(M, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.5
    if kind != "autocast":
        x, weight = x.to(dt), weight.to(dt)
    if labels:
        teacher = torch.randint(0, V, (N,), generator=g)
        teacher[3] = -100  # F.cross_entropy's ignore_index: loss, gradient and hit 0
    else:
        teacher = (torch.randn(N, V, generator=g) * 3).to(dt)
    index = torch.randint(0, N, (M,), generator=g)
    index[:2] = 3  # the rows of the ignored label (labels) / a shared teacher row
    row_weight = torch.rand(M, generator=g)
    row_weight[4] = 0.0
    return spec, labels, kind == "autocast", x, weight, teacher, index, row_weight


def _run(fn, x: torch.Tensor, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    x, weight = x.clone().requires_grad_(), weight.clone().requires_grad_()
    out = fn(x, weight)
    out.loss_sum.backward()
    return {"loss_sum": out.loss_sum.detach().float(), "row_loss": out.row_loss, "row_hit": out.row_hit,
            "grad_x": x.grad, "grad_w": weight.grad}


def _distill_case(case: str) -> dict[str, dict[str, torch.Tensor]]:
    spec, labels, autocast, x, weight, teacher, index, row_weight = _inputs(case)

    def fused(x, w):
        return fl.fused_linear_distill(x, w, teacher, index, row_weight, spec, labels=labels, chunk_rows=CHUNK)

    def torch_path(x, w):
        return chunked_distill(x, lambda h: F.linear(h, w), teacher, index, row_weight, spec, chunk_size=CHUNK,
                               labels=labels, vocab_size=V)

    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        return {"fused": _run(fused, x, weight), "torch": _run(torch_path, x, weight)}


def _kernel_inputs(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draft / target logits ``(6, 70)`` with the edge cases the kernel must get right, and row weights."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(KERNEL_ROWS, KERNEL_V, generator=g) * 2
    t = torch.randn(KERNEL_ROWS, KERNEL_V, generator=g) * 3
    s[1, [5, 40]] = t[1, 5] = 20.0  # tie across tiles: argmax s is 5 (first), as t's: hit
    s[2, [10, 20]] = t[2, 10] = 20.0  # tie inside a tile: argmax s is 10 (first), as t's: hit
    s[3, [40, 65]] = t[3, 65] = 20.0  # argmax s 40 (first), t 65: no hit
    # row 4: p = (1/2, 1/2, 0, ...), q = (1/2, 0, 1/2, 0, ...): exact ties p == q at 0 and 3.. (tv's 1/2 rule)
    s[4], t[4] = -1e4, -1e4
    s[4, [0, 2]] = t[4, [0, 1]] = 0.0
    # row 5: p ~ (1, e^-16), q ~ (e^-16, 1): alpha ~ 2e-7 is below lk_alpha's floor, where clamp_min
    # passes no gradient (dalpha/ds is not 0 there: q_0 < p_0)
    s[5], t[5] = -1e4, -1e4
    s[5, :2], t[5, :2] = torch.tensor([-16.0, 0.0]), torch.tensor([0.0, -16.0])
    return s, t, torch.rand(KERNEL_ROWS, generator=g) + 0.5


def _kernel_case(case: str, accept_temperature: float = 0.0) -> dict[str, torch.Tensor]:
    kind, temp = case.split("-")
    spec = LossSpec(kind, lk_kl_scale=1.5, lk_kl_decay=2.0, target_temperature=float(temp[1:]))
    s, t, w = _kernel_inputs()
    logits = s.clone()
    loss, hit = torch.empty(KERNEL_ROWS), torch.empty(KERNEL_ROWS)
    alpha = torch.full((KERNEL_ROWS,), -1.0) if accept_temperature else None
    fl._launch_kernel(logits, t, torch.arange(KERNEL_ROWS), w, loss, hit, spec, False, True, block_v=KERNEL_BLOCK,
                      row_alpha=alpha, accept_temperature=accept_temperature)
    ref = s.clone().requires_grad_()
    d = spec(t, ref)  # LossSpec: divergence(kind, t / T, s)
    (w * d).sum().backward()
    out = {"loss": loss, "hit": hit, "grad": logits, "ref_loss": d.detach(), "ref_grad": ref.grad,
           "ref_hit": (s.argmax(-1) == t.argmax(-1)).float()}
    if accept_temperature:  # the target's raw logits (not over distill_temperature) and the draft's, over Ta
        out.update(alpha=alpha, ref_alpha=expected_acceptance(t, s, accept_temperature))
    return out


def _opd_kernel_case(case: str) -> dict[str, torch.Tensor]:
    """The kernel with REVERSE against autograd of ``w * D + w_r * KL(q || p)`` on the edge rows of
    :func:`_kernel_inputs`: row 0 has the reverse term only (w = 0: reach 0 at hard), row 1 D only
    (w_r = 0: reach 1), row 2 neither (an untrained row: no gradient at all)."""
    kind, temp = case.split("-")
    spec = LossSpec(kind, lk_kl_scale=1.5, lk_kl_decay=2.0, target_temperature=float(temp[1:]))
    s, t, w = _kernel_inputs()
    w_r = torch.rand(KERNEL_ROWS, generator=torch.Generator().manual_seed(5)) + 0.5
    w[0] = w_r[1] = w[2] = w_r[2] = 0.0
    logits = s.clone()
    loss, hit, rev = torch.empty(KERNEL_ROWS), torch.empty(KERNEL_ROWS), torch.full((KERNEL_ROWS,), -1.0)
    fl._launch_kernel(logits, t, torch.arange(KERNEL_ROWS), w, loss, hit, spec, False, True, block_v=KERNEL_BLOCK,
                      rejected_weight=w_r, row_rejected=rev)
    ref = s.clone().requires_grad_()
    d = spec(t, ref)
    r = LossSpec("reverse_kl", target_temperature=spec.target_temperature)(t, ref)
    (w * d + w_r * r).sum().backward()
    return {"loss": loss, "rev": rev, "hit": hit, "grad": logits, "ref_loss": d.detach(), "ref_rev": r.detach(),
            "ref_grad": ref.grad, "ref_hit": (s.argmax(-1) == t.argmax(-1)).float()}


def _opd_case(case: str) -> dict[str, dict[str, torch.Tensor]]:
    """fused_linear_distill with draft.opd's ``rejected_weight`` (EAGLE-3's step: the caller's reach)
    against chunked_distill's torch path: ``w * reach`` on D, ``w * (1 - reach) * 0.7`` on KL(q || p)."""
    mode, kind, dtype = case.split("-")
    accept = AcceptSpec(mode, 0.6, 0, 0.7)
    spec, _, _, x, weight, teacher, index, row_weight = _inputs(f"{kind}-{dtype}-T0.7", seed=5)
    reach = torch.tensor(OPD_REACH)
    accepted, rejected = row_weight * reach, row_weight * (1 - reach) * 0.7

    def run(fn):
        out = _run(fn, x, weight)
        out.update(row_rejected=fn.last.row_rejected, row_alpha=fn.last.row_alpha)
        return out

    def fused(x, w):
        fused.last = fl.fused_linear_distill(x, w, teacher, index, accepted, spec, chunk_rows=CHUNK, accept=accept,
                                             rejected_weight=rejected)
        return fused.last

    def torch_path(x, w):
        torch_path.last = chunked_distill(x, lambda h: F.linear(h, w), teacher, index, accepted, spec,
                                          chunk_size=CHUNK, fused=False, accept=accept, rejected_weight=rejected)
        return torch_path.last

    return {"fused": run(fused), "torch": run(torch_path)}


def _labels_kernel_case() -> dict[str, torch.Tensor]:
    s, _, w = _kernel_inputs()
    y = torch.tensor([3, 40, 10, 65, -100, KERNEL_V + 2])  # -100: ignore_index; V + 2: out of range, ignored
    logits = s.clone()
    loss, hit = torch.empty(KERNEL_ROWS), torch.empty(KERNEL_ROWS)
    fl._launch_kernel(logits, y, torch.arange(KERNEL_ROWS), w, loss, hit, LossSpec(), True, True, block_v=KERNEL_BLOCK)
    ref = s[:5].clone().requires_grad_()
    d = F.cross_entropy(ref, y[:5], reduction="none")
    (w[:5] * d).sum().backward()
    return {"loss": loss, "hit": hit, "grad": logits, "ref_loss": d.detach(), "ref_grad": ref.grad,
            "ref_hit": (s[:5].argmax(-1) == y[:5]).float()}


class _Allocations(torch.utils._python_dispatch.TorchDispatchMode):
    """The largest fresh allocation (elements of an op's output whose storage is none of its
    inputs': ``out=`` and in-place results and views are not allocations) and host reads."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0
        self.syncs: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if str(func) in ("aten._local_scalar_dense.default", "aten.nonzero.default"):
            self.syncs.append(str(func))
        inputs = {a.untyped_storage().data_ptr() for a in (*args, *kwargs.values())
                  if isinstance(a, torch.Tensor) and a.numel()}
        for o in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(o, torch.Tensor) and o.numel() and o.untyped_storage().data_ptr() not in inputs:
                self.largest = max(self.largest, o.untyped_storage().nbytes() // o.element_size())
        return out


def _memory_case() -> dict[str, Any]:
    m, c, v, h = 24, 4, 70, 16  # M * V = 1680 > V * H = 1120 > C * V = 280
    g = torch.Generator().manual_seed(2)
    x = torch.randn(m, h, generator=g, requires_grad=True)
    weight = torch.randn(v, h, generator=g, requires_grad=True)
    teacher, index, row_weight = torch.randn(5, v, generator=g), torch.randint(0, 5, (m,), generator=g), torch.ones(m)
    fused = _Allocations()
    with fused:
        fl.fused_linear_distill(x, weight, teacher, index, row_weight, LossSpec("jsd"), chunk_rows=c).loss_sum.backward()
    unchunked = _Allocations()  # the tracker sees an (M, V) tensor where one is made
    with unchunked:
        F.linear(x, weight).sum().backward()
    return {"fused": fused.largest, "syncs": fused.syncs, "unchunked": unchunked.largest,
            "bound": max(c * v, v * h, m * h), "mv": m * v}


def _checkpoint_case() -> dict[str, Any]:
    """The fused call inside a non-reentrant checkpoint region: same gradients as the torch path, and
    backward's recomputation stops before it (its gradients live on ctx, not as saved tensors)."""
    from torch.utils.checkpoint import checkpoint

    spec, _, _, x, weight, teacher, index, row_weight = _inputs("reverse_kl-float32-T1.0")
    launches = [0]
    launch = fl._launch_kernel

    def counting(*args, **kwargs):
        launches[0] += 1
        return launch(*args, **kwargs)

    fl._launch_kernel = counting
    try:
        def region(h, w):
            return fl.fused_linear_distill(torch.tanh(h), w, teacher, index, row_weight, spec, chunk_rows=CHUNK)

        fused = _run(lambda h, w: checkpoint(region, h, w, use_reentrant=False), x, weight)
    finally:
        fl._launch_kernel = launch
    ref = _run(lambda h, w: chunked_distill(torch.tanh(h), lambda r: F.linear(r, w), teacher, index, row_weight, spec,
                                            chunk_size=CHUNK), x, weight)
    return {"fused": fused, "torch": ref, "launches": launches[0]}


def _accept_case(case: str) -> dict[str, dict[str, torch.Tensor]]:
    """fused_linear_distill against chunked_distill with an AcceptSpec: M = 8 rows in chunks of 3
    (rounded to whole groups: 2 rows for groups of 2, 4 for groups of 4)."""
    name, dtype = case.rsplit("-", 1)
    accept = ACCEPT[name]
    spec, _, _, x, weight, teacher, index, row_weight = _inputs(f"tv-{dtype}-T0.7", seed=4)

    def run(fn):
        out = _run(fn, x, weight)
        out["row_alpha"], out["row_reach"] = fn.last.row_alpha, fn.last.row_reach
        return out

    def fused(x, w):
        fused.last = fl.fused_linear_distill(x, w, teacher, index, row_weight, spec, chunk_rows=CHUNK, accept=accept)
        return fused.last

    def torch_path(x, w):
        torch_path.last = chunked_distill(x, lambda h: F.linear(h, w), teacher, index, row_weight, spec,
                                          chunk_size=CHUNK, fused=False, accept=accept)
        return torch_path.last

    return {"fused": run(fused), "torch": run(torch_path)}


def _ttt_accept_case(mode: str) -> dict[str, dict[str, Any]]:
    """EAGLE-3's TTT loss (``ttt_loss``) with ``draft.accept_weighting`` on a tiny draft, the fused
    loss (its CUDA-only check lifted, the kernel interpreted) against the chunked torch path."""
    from draftsmith.models.eagle3.config import Eagle3Config
    from draftsmith.models.eagle3.model import Eagle3DraftModel
    from draftsmith.models.eagle3.training import eagle3_batch_plan, ttt_loss
    from draftsmith.train.losses import TargetDraftHead

    accept = AcceptSpec(mode[4:], 0.6, 0, 0.7) if mode.startswith("opd-") else AcceptSpec(mode, 0.6)
    torch.manual_seed(0)
    cfg = Eagle3Config(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=8, vocab_size=100, draft_vocab_size=3, aux_layer_ids=[0, 1, 2])
    model = Eagle3DraftModel(cfg)  # a draft vocab of 3: the argmaxes agree often, chains of mixed length
    model.init_from_target(torch.randn(100, 32))
    head = TargetDraftHead(torch.randn(3, 32))
    B, T = 2, 16
    mask = torch.ones(B, T, dtype=torch.long)
    mask[:, :2] = 0
    mask[0, 9] = 0
    batch = {"input_ids": torch.randint(0, 100, (B, T)), "loss_mask": mask}
    aux, final = torch.randn(B, T, 96), torch.randn(B, T, 32)
    plan = eagle3_batch_plan(batch, 3)
    results = {}
    with _counted_fused_loss() as counts:
        for path, setting in (("fused", True), ("torch", False)):
            model.zero_grad()
            total, metrics = ttt_loss(model, batch["input_ids"], aux, final, plan, 3, head, 0.8, None, 5,
                                      fused=setting, accept=accept)
            total.backward()
            results[path] = {"loss": total.detach(), "metrics": {k: v.detach() for k, v in metrics.items()},
                             "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}}
    return {**results, **counts}


@contextlib.contextmanager
def _counted_fused_loss() -> Iterator[dict[str, int]]:
    """The fused loss on CPU tensors (its CUDA-only check lifted, the kernel interpreted), counting
    its calls (``fused_linear_distill``) and kernel launches into the dict it yields."""
    from draftsmith.train import losses

    counts = {"launches": 0, "calls": 0}
    ok, launch, fused_call = losses.fused_device_ok, fl._launch_kernel, fl.fused_linear_distill

    def counting(*args, **kwargs):
        counts["launches"] += 1
        return launch(*args, **kwargs)

    def counting_calls(*args, **kwargs):
        counts["calls"] += 1
        return fused_call(*args, **kwargs)

    try:
        losses.fused_device_ok = lambda device: True
        fl._launch_kernel, fl.fused_linear_distill = counting, counting_calls
        yield counts
    finally:
        losses.fused_device_ok = ok
        fl._launch_kernel, fl.fused_linear_distill = launch, fused_call


def _opd_group_case(case: str) -> dict[str, Any]:
    """``opd_group_distill`` (draft.opd over groups of 4 rows, a block drafter's slots) with the fused
    loss (its CUDA-only check lifted, the kernel interpreted) against the chunked torch path."""
    from draftsmith.train import losses
    from draftsmith.train.opd_loss import opd_group_distill

    mode, dtype = case.split("-")
    accept = AcceptSpec(mode, 0.6, 4, 0.7)
    spec, _, _, x, weight, teacher, index, row_weight = _inputs(f"forward_kl-{dtype}-T1.0", seed=4)
    ok, launch, launches = losses.fused_device_ok, fl._launch_kernel, [0]

    def counting(*args, **kwargs):
        launches[0] += 1
        return launch(*args, **kwargs)

    def run(setting):
        def fn(x, w):
            head = torch.nn.Linear(H, V, bias=False)  # a bias-free nn.Linear: the fused loss's head
            del head.weight
            head.weight = w
            fn.last = opd_group_distill(x, head, teacher, index, row_weight, spec, CHUNK, accept=accept, fused=setting)
            return fn.last
        out = _run(fn, x, weight)
        out.update(row_rejected=fn.last.row_rejected, row_reach=fn.last.row_reach)
        return out

    try:
        losses.fused_device_ok = lambda device: True
        fl._launch_kernel = counting
        return {"fused": run(True), "torch": run(False), "launches": launches[0]}
    finally:
        losses.fused_device_ok = ok
        fl._launch_kernel = launch


def _peagle_accept_case(mode: str) -> dict[str, Any]:
    """P-EAGLE's step (``compute_loss``) with ``draft.accept_weighting`` or ``draft.opd`` on a tiny draft
    (tests/helpers/ttt_cases.py), the fused loss (its CUDA-only check lifted, the kernel interpreted)
    against the chunked torch path: the same weights (``row_reach``), loss, metrics and gradients."""
    from draftsmith.models.peagle import training
    from helpers.ttt_cases import peagle_case

    split = mode.removeprefix("opd-")
    keys = {"opd" if mode.startswith("opd-") else "accept_weighting": split,
            "temperature": 0.6 if split == "soft" else 0.0}
    metric, seen, results = training.cod_loss, {}, {}

    def cod_loss(out, *args):
        seen["out"] = out
        return metric(out, *args)

    try:
        training.cod_loss = cod_loss
        with _counted_fused_loss() as counts:
            for path, setting in (("fused", True), ("torch", False)):
                method, model, batch = peagle_case(fused_loss=setting, **keys)
                total, metrics = method.compute_loss(model, {**batch, **method.batch_plan()(batch)})
                total.backward()
                results[path] = {"loss": total.detach(), "metrics": {k: v.detach() for k, v in metrics.items()},
                                 "row_reach": seen["out"].row_reach, "row_loss": seen["out"].row_loss,
                                 "grads": {n: p.grad.clone() for n, p in model.named_parameters()
                                           if p.grad is not None}}
    finally:
        training.cod_loss = metric
    return {**results, **counts}


def _worker(path: str) -> None:
    assert fl.interpreted(), "run with TRITON_INTERPRET=1"
    fl.MAX_BLOCK_V = BLOCK
    torch.save({"distill": {c: _distill_case(c) for c in CASES},
                "kernel": {**{c: _kernel_case(c) for c in KERNEL_CASES}, "labels": _labels_kernel_case()},
                "soft_kernel": {c: _kernel_case(c, accept_temperature=0.6) for c in SOFT_KERNEL_CASES},
                "accept": {c: _accept_case(c) for c in ACCEPT_CASES},
                "ttt_accept": {c: _ttt_accept_case(c) for c in TTT_ACCEPT_CASES},
                "peagle_accept": {c: _peagle_accept_case(c) for c in PEAGLE_ACCEPT_CASES},
                "opd_group": {c: _opd_group_case(c) for c in OPD_GROUP_CASES},
                "opd_kernel": {c: _opd_kernel_case(c) for c in OPD_KERNEL_CASES},
                "opd": {c: _opd_case(c) for c in OPD_CASES},
                "memory": _memory_case(), "checkpoint": _checkpoint_case()}, path)


# --------------------------------------------------------------------------------------
# the tests


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict[str, Any]:
    if fl.triton is None:
        pytest.skip("triton is not importable")
    path = tmp_path_factory.mktemp("fused_loss") / "results.pt"
    proc = subprocess.run([sys.executable, __file__, str(path)], env={**os.environ, "TRITON_INTERPRET": "1"},
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return torch.load(path)


def _tolerances(case: str) -> tuple[float, float]:
    """(atol relative to the reference's largest magnitude, rtol) for the gradients. fp32: the two
    paths differ by summation order only. bf16: both round ``dD/dlogits`` to bf16 and each matmul's
    output to bf16 (the torch path also sums its per-chunk weight gradients in bf16, the fused one
    in fp32), so they may differ by a bf16 ulp or two: at most 2 * eps(bf16) of the largest value."""
    return (1e-5, 1e-4) if "float32" in case else (2 * torch.finfo(torch.bfloat16).eps, 0.0)


def _close(got: torch.Tensor, want: torch.Tensor, rel_atol: float, rtol: float) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=rel_atol * float(want.abs().max()))


@pytest.mark.parametrize("case", CASES)
def test_fused_linear_distill_equals_the_chunked_torch_path(interpreted, case):
    got, want = interpreted["distill"][case]["fused"], interpreted["distill"][case]["torch"]
    # the losses come from the same logits (bf16 too) in fp32 on both paths
    torch.testing.assert_close(got["loss_sum"], want["loss_sum"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got["row_loss"], want["row_loss"], rtol=1e-5, atol=1e-5)
    assert got["row_loss"].dtype == got["row_hit"].dtype == torch.float32
    assert torch.equal(got["row_hit"], want["row_hit"])
    rel_atol, rtol = _tolerances(case)
    _close(got["grad_x"], want["grad_x"], rel_atol, rtol)
    _close(got["grad_w"], want["grad_w"], rel_atol, rtol)
    assert want["grad_w"].abs().max() > 0 and want["grad_x"].abs().max() > 0
    if case.startswith("labels"):  # rows 0 and 1 have the ignored label -100
        assert got["row_loss"][:2].tolist() == [0.0, 0.0] and got["row_hit"][:2].tolist() == [0.0, 0.0]
        assert not got["grad_x"][:2].any()


@pytest.mark.parametrize("case", [*KERNEL_CASES, "labels"])
def test_the_row_kernel_equals_autograd_of_the_divergence(interpreted, case):
    r = interpreted["kernel"][case]
    rows = 5 if case == "labels" else KERNEL_ROWS  # labels: row 5's id is out of range (torch raises)
    torch.testing.assert_close(r["loss"][:rows], r["ref_loss"], rtol=1e-5, atol=1e-5)
    # atol: reverse_kl's row 5 gradient q (log q - log p - D) cancels terms of 16 (fp32 ulp ~2e-6)
    torch.testing.assert_close(r["grad"][:rows], r["ref_grad"], rtol=1e-4, atol=1e-5)
    assert torch.equal(r["hit"][:rows], r["ref_hit"])
    if case == "labels":
        assert r["loss"][5] == 0 and r["hit"][5] == 0 and not r["grad"][5].any()
        assert r["hit"][1:4].tolist() == [0.0, 1.0, 0.0]  # argmax s (first on ties) 5, 10, 40 vs labels 40, 10, 65
    else:  # first index on ties, inside a tile and across tiles
        assert r["hit"][1:4].tolist() == [1.0, 1.0, 0.0]
    if case.startswith(("tv", "lk_alpha", "lk_lambda")):
        assert r["grad"][4].abs().max() > 0.01  # the tie row's gradient is not trivially 0
    if case.startswith("lk_alpha"):  # alpha below the floor: -log(floor), no gradient
        assert r["loss"][5].item() == pytest.approx(-torch.log(torch.tensor(1e-6)).item())
        assert not r["grad"][5].any()


@pytest.mark.parametrize("case", SOFT_KERNEL_CASES)
def test_the_row_kernel_writes_the_expected_acceptance_beside_an_unchanged_loss(interpreted, case):
    r = interpreted["soft_kernel"][case]
    torch.testing.assert_close(r["alpha"], r["ref_alpha"], rtol=1e-5, atol=1e-6)
    assert 0 < float(r["alpha"].min()) and float(r["alpha"].max()) < 1
    torch.testing.assert_close(r["loss"], r["ref_loss"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(r["grad"], r["ref_grad"], rtol=1e-4, atol=1e-5)
    assert torch.equal(r["hit"], r["ref_hit"])


@pytest.mark.parametrize("case", ACCEPT_CASES)
def test_fused_linear_distill_with_accept_weighting_equals_the_chunked_torch_path(interpreted, case):
    got, want = interpreted["accept"][case]["fused"], interpreted["accept"][case]["torch"]
    torch.testing.assert_close(got["loss_sum"], want["loss_sum"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got["row_loss"], want["row_loss"], rtol=1e-5, atol=1e-5)
    assert torch.equal(got["row_hit"], want["row_hit"])
    for key in ("row_alpha", "row_reach"):
        assert (got[key] is None) == (want[key] is None), key
        if want[key] is not None:
            torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6)
    if "group" in case:  # some rows were cut (or scaled) and some kept: the case tests something
        assert float(want["row_reach"].max()) == 1.0 and float(want["row_reach"].min()) < 0.5
    rel_atol, rtol = _tolerances(case)
    if "bfloat16" in case and "soft-group" in case:  # the reach scales x's rows in bf16 (one more rounding)
        rel_atol *= 2
    _close(got["grad_x"], want["grad_x"], rel_atol, rtol)
    _close(got["grad_w"], want["grad_w"], rel_atol, rtol)


@pytest.mark.parametrize("case", TTT_ACCEPT_CASES)
def test_the_ttt_loss_with_accept_weighting_is_the_same_fused_and_chunked(interpreted, case):
    r = interpreted["ttt_accept"][case]
    got, want = r["fused"], r["torch"]
    assert r["launches"] > 0  # the fused path ran
    # one fused call per TTT step (3), draft.opd's reverse KL included: the same calls and kernel
    # launches (one per chunk) as accept_weighting at the same mode
    assert r["calls"] == 3
    assert r["launches"] == interpreted["ttt_accept"][case.removeprefix("opd-")]["launches"]
    torch.testing.assert_close(got["loss"], want["loss"], rtol=1e-5, atol=1e-6)
    assert set(got["metrics"]) == set(want["metrics"]) and "reach_2" in want["metrics"]
    for key, value in want["metrics"].items():
        torch.testing.assert_close(got["metrics"][key], value, rtol=1e-5, atol=1e-6, msg=key)
    assert 0 < float(want["metrics"]["reach_2"]) < 1
    assert set(got["grads"]) == set(want["grads"])
    for name, grad in want["grads"].items():
        torch.testing.assert_close(got["grads"][name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("case", PEAGLE_ACCEPT_CASES)
def test_the_peagle_step_with_accept_weighting_is_the_same_fused_and_chunked(interpreted, case):
    r = interpreted["peagle_accept"][case]
    got, want = r["fused"], r["torch"]
    # one fused call per depth (4), one launch per call (one chunk each); draft.opd's reverse KL in the same calls
    assert r["calls"] == 4 and r["launches"] == 4
    assert r["launches"] == interpreted["peagle_accept"][case.removeprefix("opd-")]["launches"]
    torch.testing.assert_close(got["row_reach"], want["row_reach"], rtol=1e-5, atol=1e-6)  # the weights
    torch.testing.assert_close(got["row_loss"], want["row_loss"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got["loss"], want["loss"], rtol=1e-5, atol=1e-6)
    assert set(got["metrics"]) == set(want["metrics"]) and "reach_3" in want["metrics"]
    for key, value in want["metrics"].items():
        torch.testing.assert_close(got["metrics"][key], value, rtol=1e-5, atol=1e-6, msg=key)
    assert 0 < float(want["metrics"]["reach_3"]) < 1
    assert set(got["grads"]) == set(want["grads"]) and "mask_hidden" in want["grads"]
    for name, grad in want["grads"].items():
        torch.testing.assert_close(got["grads"][name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("case", OPD_GROUP_CASES)
def test_opd_over_a_block_drafter_s_slots_is_the_same_fused_and_chunked(interpreted, case):
    r = interpreted["opd_group"][case]
    got, want = r["fused"], r["torch"]
    assert r["launches"] > 0  # the fused path ran (both terms)
    torch.testing.assert_close(got["loss_sum"], want["loss_sum"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got["row_loss"], want["row_loss"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got["row_rejected"], want["row_rejected"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got["row_reach"], want["row_reach"], rtol=1e-5, atol=1e-6)
    assert float(want["row_reach"].max()) == 1.0 and float(want["row_reach"].min()) < 0.5  # both terms exercised
    assert torch.equal(got["row_hit"], want["row_hit"])
    rel_atol, rtol = _tolerances(case)
    if "bfloat16" in case:  # the reach scales x's rows in bf16 (one more rounding), as with accept_weighting
        rel_atol *= 2
    _close(got["grad_x"], want["grad_x"], rel_atol, rtol)
    _close(got["grad_w"], want["grad_w"], rel_atol, rtol)


@pytest.mark.parametrize("case", OPD_KERNEL_CASES)
def test_the_row_kernel_adds_the_weighted_reverse_kl_to_every_kind(interpreted, case):
    r = interpreted["opd_kernel"][case]
    torch.testing.assert_close(r["loss"], r["ref_loss"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(r["rev"], r["ref_rev"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(r["grad"], r["ref_grad"], rtol=1e-4, atol=1e-5)
    assert torch.equal(r["hit"], r["ref_hit"])
    assert not r["grad"][2].any()  # both weights 0: no gradient
    assert r["grad"][0].abs().max() > 0.01 and r["grad"][1].abs().max() > 0.01  # one term each


@pytest.mark.parametrize("case", OPD_CASES)
def test_fused_linear_distill_with_the_rejected_term_equals_the_chunked_torch_path(interpreted, case):
    got, want = interpreted["opd"][case]["fused"], interpreted["opd"][case]["torch"]
    torch.testing.assert_close(got["loss_sum"], want["loss_sum"], rtol=1e-5, atol=1e-5)
    for key in ("row_loss", "row_rejected"):
        assert got[key].dtype == torch.float32 and got[key].shape == (M,)
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-5, msg=key)
    assert torch.equal(got["row_hit"], want["row_hit"])
    assert (got["row_alpha"] is None) == (want["row_alpha"] is None) == case.startswith("hard")
    if want["row_alpha"] is not None:
        torch.testing.assert_close(got["row_alpha"], want["row_alpha"], rtol=1e-5, atol=1e-6)
    rel_atol, rtol = _tolerances(case)
    _close(got["grad_x"], want["grad_x"], rel_atol, rtol)
    _close(got["grad_w"], want["grad_w"], rel_atol, rtol)
    assert not want["grad_x"][4].any() and not got["grad_x"][4].any()  # the zero-weight row


def test_no_tensor_of_m_by_v_elements_and_no_host_read(interpreted):
    r = interpreted["memory"]
    assert r["unchunked"] >= r["mv"]  # the tracker sees the (M, V) logits where they exist
    assert 0 < r["fused"] <= r["bound"] < r["mv"]
    assert r["syncs"] == []


def test_inside_activation_checkpointing_the_kernel_is_not_rerun(interpreted):
    r = interpreted["checkpoint"]
    assert r["launches"] == 3  # 3 chunks in forward, none in backward's recomputation
    for key in ("loss_sum", "row_loss", "grad_x", "grad_w"):
        torch.testing.assert_close(r["fused"][key], r["torch"][key], rtol=1e-4, atol=1e-5)


@COMPILED
def test_the_kernel_compiles_for_an_h100_h200_without_a_gpu(tmp_path, monkeypatch):
    # the interpreter accepts what the compiler may not: compile every kind to a sm_90 cubin
    # (Triton's own ptxas; no device needed) at the default tile and warps, bf16 rows and teacher
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # 3.9's default, set to silence its warning
    kernel = fl._kernel()
    # every kind; with SOFT (draft.accept_weighting: soft's expected acceptance) and with REVERSE
    # (draft.opd's reverse KL; soft and hard) every kind but labels
    variants = ([(kind, False, False) for kind in range(7)] + [(kind, True, False) for kind in range(6)]
                + [(kind, soft, True) for kind in range(6) for soft in (False, True)])
    for kind, soft, reverse in variants:
        signature = {"s_ptr": "*bf16", "s_stride": "i32", "t_ptr": "*i64" if kind == 6 else "*bf16",
                     "t_stride": "i64", "idx_ptr": "*i64", "w_ptr": "*fp32", "loss_ptr": "*fp32", "hit_ptr": "*fp32",
                     "acc_ptr": "*fp32", "wr_ptr": "*fp32", "rev_ptr": "*fp32", "V": "i32", "temperature": "fp32",
                     "kl_scale": "fp32", "kl_decay": "fp32", "alpha_floor": "fp32", "accept_s": "fp32",
                     "accept_t": "fp32", "KIND": "constexpr", "WRITE_GRAD": "constexpr", "SOFT": "constexpr",
                     "REVERSE": "constexpr", "BLOCK_V": "constexpr"}
        source = ASTSource(kernel, signature, {"KIND": kind, "WRITE_GRAD": True, "SOFT": soft, "REVERSE": reverse,
                                               "BLOCK_V": fl.MAX_BLOCK_V})
        compiled = compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 16})
        assert compiled.asm["cubin"], (kind, soft, reverse)


def test_empty_rows_give_a_zero_loss_with_a_graph_to_x_and_weight():
    x = torch.zeros(0, H, requires_grad=True)
    weight = torch.randn(V, H, requires_grad=True)
    out = fl.fused_linear_distill(x, weight, torch.randn(N, V), torch.zeros(0, dtype=torch.long), torch.zeros(0))
    assert out.loss_sum.item() == 0.0 and out.loss_sum.requires_grad
    assert out.row_loss.shape == out.row_hit.shape == (0,) and out.row_loss.dtype == torch.float32
    out.loss_sum.backward()
    assert weight.grad is not None and not weight.grad.any() and x.grad is not None and x.grad.shape == (0, H)


def test_bad_arguments_raise_before_any_kernel():
    x, weight, teacher = torch.randn(4, H), torch.randn(V, H), torch.randn(N, V)
    index, w = torch.zeros(4, dtype=torch.long), torch.ones(4)
    with pytest.raises(ValueError, match="unknown loss"):
        fl.fused_linear_distill(x, weight, teacher, index, w, LossSpec("hinge"))
    with pytest.raises(ValueError, match="teacher"):
        fl.fused_linear_distill(x, weight, teacher[:, :-1], index, w)
    with pytest.raises(ValueError, match="dtype"):
        fl.fused_linear_distill(x, weight.double(), teacher, index, w)
    with pytest.raises(ValueError, match=r"\(4,\)"):
        fl.fused_linear_distill(x, weight, teacher, index[:3], w)


@COMPILED
def test_cpu_tensors_without_the_interpreter_raise():
    x, weight, teacher = torch.randn(4, H), torch.randn(V, H), torch.randn(N, V)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        fl.fused_linear_distill(x, weight, teacher, torch.zeros(4, dtype=torch.long), torch.ones(4))


def test_availability_and_default_chunk():
    ok, reason = fl.fused_loss_available(torch.device("cpu"), torch.bfloat16, LossSpec())
    assert not ok and "CUDA" in reason
    assert fl.fused_loss_available("cuda", torch.bfloat16, LossSpec("jsd")) == (True, "")  # reads no device
    assert fl.fused_loss_available("cuda:0", torch.float32, LossSpec("hinge"), labels=True) == (True, "")
    ok, reason = fl.fused_loss_available("cuda", torch.float32, LossSpec("hinge"))
    assert not ok and "hinge" in reason
    ok, reason = fl.fused_loss_available("cuda", torch.float64, LossSpec())
    assert not ok and "float64" in reason
    assert fl.fused_chunk_rows(32000, torch.bfloat16) == 4194 and fl.fused_chunk_rows(32000, torch.float32) == 2097
    assert fl.fused_chunk_rows(128256, torch.bfloat16) == 1046 and fl.fused_chunk_rows(10, torch.float32, 7) == 7


def test_availability_without_triton(monkeypatch):
    monkeypatch.setattr(fl, "triton", None)
    ok, reason = fl.fused_loss_available("cuda", torch.bfloat16, LossSpec())
    assert not ok and "triton" in reason


def test_the_kernels_coverage_is_availability_without_the_process():
    """:func:`fused_kernel_covers` is the part of availability a dry run can decide on any machine
    (row dtype, loss kind); the device and Triton checks come first in :func:`fused_loss_available`."""
    assert fl.fused_kernel_covers(torch.bfloat16, LossSpec("tv")) == (True, "")
    assert fl.fused_kernel_covers(torch.float32, LossSpec("hinge"), labels=True) == (True, "")
    ok, reason = fl.fused_kernel_covers(torch.float32, LossSpec("hinge"))
    assert not ok and reason == fl.fused_loss_available("cuda", torch.float32, LossSpec("hinge"))[1]
    ok, reason = fl.fused_kernel_covers(torch.float64)
    assert not ok and "float64" in reason
    ok, reason = fl.fused_loss_available("cpu", torch.float64)
    assert not ok and "CUDA" in reason  # the device first


if __name__ == "__main__":  # the interpreter subprocess of the fixture `interpreted`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: its helpers
    _worker(sys.argv[1])
