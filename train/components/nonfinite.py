"""Non-finite steps: skipped on the device, counted, and traced back to their shard.

- :class:`NonFiniteGuard`: a step pre-hook of the optimizers that hands the fused AdamW a
  ``found_inf`` flag (any non-finite loss of the accumulation window, the gradient norm, under
  DeepSpeed the gradients about to be applied; max over ranks), or puts a non-fused optimizer's
  parameters and state back where it is set; its counters stay on the device until read.
- :class:`NonFiniteShards`: with offline shards, non-finite hidden states counted per shard on the
  device, warned about once per shard.
- :class:`NonFiniteLossError`: ``train.max_nonfinite_steps`` skipped steps in a row.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from ..data import recompute_hint

if TYPE_CHECKING:
    from ..checkpoint import TrainState

log = logging.getLogger("draftsmith.train")


class NonFiniteLossError(RuntimeError):
    """Too many consecutive optimizer steps with a NaN/inf loss or gradient."""



def _step_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors an optimizer step changes: every parameter of ``optimizer``, then the tensors
    of its per-parameter state (momentum buffers, moments, tensor step counts), in a fixed order."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = [v for p in params for v in optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor)]
    return params + state


def _is_fused(optimizer: torch.optim.Optimizer) -> bool:
    """Whether every group of ``optimizer`` runs a fused kernel that reads ``found_inf``."""
    return all(group.get("fused") for group in optimizer.param_groups)


class NonFiniteGuard:
    """Skips an optimizer step whose loss or gradient is not finite, on the device, on every rank.

    Installed as a step pre-hook of the (fused) AdamW, so it acts at the last moment before the
    weights change, under every launcher: in the trainer's ``optimizer.step()`` (one process,
    DDP, FSDP2) and inside DeepSpeed's ``engine.step()``, which accelerate runs from
    ``accelerator.backward`` at the accumulation boundary. The flag is the max over ranks
    (all-reduce) of: any non-finite loss of this rank's micro-batches in the accumulation window
    (:meth:`note_loss`, before each backward), the gradient norm (:meth:`note_grad_norm`; global
    after clipping), and under DeepSpeed (``check_grads``) the gradients the optimizer is about to
    apply (ZeRO hands it this rank's fp32 partition). Fused AdamW reads it as ``found_inf`` and
    leaves parameters, moments and step counts untouched, as with a GradScaler. An optimizer
    without a fused kernel (``torch.optim.Muon``; AdamW on a device with none) is skipped on the
    device too: its parameters and state tensors are copied before the step (one ``_foreach_copy_``
    into buffers kept across steps) and put back after it where the flag is set (``torch.where``),
    so the step costs no host read and, for those optimizers only, one extra copy of their
    parameters and state in memory. State the step creates (the first step's momentum buffer) is
    zeroed where the flag is set.

    Counters (skipped since the last read, skipped in a row, longest run since the last read)
    stay on the device and are read with the metrics (:meth:`absorb`).
    """

    def __init__(self, optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer], device: torch.device,
                 num_processes: int, check_grads: bool = False):
        """``optimizer``: one, or the optimizers of one step (``train.optimizer: muon``: AdamW and
        Muon); the flag is computed (and all-reduced) once per step, by the first hook that runs."""
        optimizers = optimizer if isinstance(optimizer, list) else [optimizer]
        self.optimizer, self.device, self.world, self.check_grads = optimizers[0], torch.device(device), num_processes, check_grads
        self.fused = all(_is_fused(o) for o in optimizers)
        self.bad = torch.zeros((), dtype=torch.float32, device=self.device)
        self.found: torch.Tensor | None = None
        self.hook_ran = False
        self.counters = torch.zeros(3, dtype=torch.float32, device=self.device)
        self._saved: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}  # id(optimizer) -> (live, copies)
        for o in optimizers:
            o.register_step_pre_hook(self._before_step)
            if not _is_fused(o):
                o.register_step_post_hook(self._after_step)

    def restore(self, in_a_row: int) -> None:
        self.counters = torch.tensor([0.0, in_a_row, in_a_row], dtype=torch.float32).to(self.device)

    def note_loss(self, loss: torch.Tensor) -> None:
        self.bad.add_(torch.isfinite(loss.detach()).logical_not().float().reshape(()))

    def note_grad_norm(self, norm: torch.Tensor | None) -> None:
        if isinstance(norm, torch.Tensor):
            self.bad.add_(torch.isfinite(norm.detach()).logical_not().float().reshape(()).to(self.device))

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.hook_ran:  # a later optimizer of the same step: the flag is known
            flag = self.found
        else:
            flag = self._step_flag(optimizer)
        self.found, self.hook_ran = flag, True
        if _is_fused(optimizer):
            optimizer.found_inf = flag
            return
        live = _step_tensors(optimizer)
        saved = self._saved.get(id(optimizer))
        if saved is None or len(saved[0]) != len(live) or any(a is not b for a, b in zip(saved[0], live)):
            saved = (live, [t.detach().clone() for t in live])  # first step, or the state grew
            self._saved[id(optimizer)] = saved
        else:
            torch._foreach_copy_(saved[1], live)

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Put a non-fused optimizer's parameters and state back where the step's flag is set
        (device-side; no host read)."""
        skip = self.found.bool()
        before, copies = self._saved[id(optimizer)]
        kept = {id(t): c for t, c in zip(before, copies)}
        after = _step_tensors(optimizer)
        with torch.no_grad():
            for t, c in zip(before, copies):
                t.copy_(torch.where(skip, c, t))
            for t in after:
                if id(t) not in kept:  # created by this step (Muon's momentum buffer): as if never stepped
                    t.masked_fill_(skip, 0)
        if len(after) != len(before):  # the state grew: copies for it now, so later steps only copy into them
            self._saved[id(optimizer)] = (after, [kept[id(t)] if id(t) in kept else t.detach().clone() for t in after])

    def copies(self) -> list[torch.Tensor]:
        """The copies kept across steps of the non-fused optimizers' parameters and state (empty
        for fused optimizers and before the first step): memory the guard holds."""
        return [c for _, copies in self._saved.values() for c in copies]

    def _step_flag(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """1.0 where this step must be skipped on any rank, else 0.0 (0-dim device tensor)."""
        flag = (self.bad > 0).float()
        if self.check_grads:
            grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            if grads:
                norms = torch.stack([n.to(self.device) for n in torch._foreach_norm(grads)])
                flag = torch.maximum(flag, norms.isfinite().all().logical_not().float())
        if self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag

    def end_step(self, applied: bool | None = None) -> None:
        """After the optimizer step: count it. ``applied``: DeepSpeed's ``was_step_applied()``
        (host state), used when DeepSpeed skipped the step itself (fp16 / fp32 overflow) and the
        hook did not run."""
        if self.hook_ran:
            found = self.found
        else:
            found = torch.full((), 0.0 if applied else 1.0, dtype=torch.float32, device=self.device)
        c = self.counters
        run = (c[1] + 1.0) * found
        self.counters = torch.stack([c[0] + found, run, torch.maximum(c[2], run)])
        self.bad.zero_()
        self.hook_ran = False

    def absorb(self, values: list[float], state: "TrainState", max_in_a_row: int, last_ckpt: Any,
               cause: str | None = None) -> None:
        """Take the counters read on the host (``values``, from
        :meth:`~draftsmith.train.components.metrics.MetricWindow.read` or :meth:`read`) into
        ``state`` and restart them.

        Raises:
            NonFiniteLossError: ``max_in_a_row`` (``train.max_nonfinite_steps``) steps in a row
                were skipped since the last read; ``cause`` (the first shard with non-finite
                hidden states, :meth:`NonFiniteShards.cause`) is appended.
        """
        skipped, in_a_row, longest = (int(round(v)) for v in values)
        state.nonfinite_skipped += skipped
        state.nonfinite_in_a_row = in_a_row
        self.counters = torch.tensor([0.0, in_a_row, in_a_row], dtype=torch.float32).to(self.device)
        if skipped:
            log.warning("step %d: %d optimizer step(s) with a non-finite loss/gradient skipped since the last report "
                        "(%d in a row now, %d in total)", state.step, skipped, in_a_row, state.nonfinite_skipped)
        if longest >= max_in_a_row:
            raise NonFiniteLossError(
                f"{longest} optimizer steps in a row had a non-finite loss or gradient "
                f"(train.max_nonfinite_steps={max_in_a_row}); last good checkpoint: {last_ckpt}"
                + (f"; {cause}" if cause else ""))

    def read(self) -> list[float]:
        """The counters on the host (checkpoint steps)."""
        return self.counters.tolist()


class NonFiniteShards:
    """Which hidden-state shards hand the trainer non-finite states, counted on the device.

    The training items carry ``sequence_index`` (:class:`~draftsmith.train.data.SourceTagged`);
    :meth:`note` (every micro-batch, before the loss) marks the real tokens whose aux or final
    states are not finite and adds them to a per-shard count, keeping the lowest sequence index
    per shard: a few small kernels, no host read (the guard's reason, see
    :class:`NonFiniteGuard`). The counts ride along with the metrics read at logging and
    checkpoint steps (:meth:`values`); :meth:`absorb` then warns once per shard, naming its file,
    the sequence in it and its record id, and notes it in ``TrainState.nonfinite_shards`` (a
    resumed run does not warn again). :meth:`cause` is the line the trainer's stop adds: the
    lowest-numbered bad shard seen, over every process.
    """

    def __init__(self, reader: Any, device: torch.device):
        self.reader, self.device = reader, torch.device(device)
        self.files = [s["file"] for s in reader.manifest["shards"]]
        number = {f: k for k, f in enumerate(self.files)}
        self.start: dict[str, int] = {}  # file -> index of its first sequence
        for g, (f, _, _) in enumerate(reader.index):
            self.start.setdefault(f, g)
        self.none = len(reader.index)
        self.shard_of = torch.tensor([number[f] for f, _, _ in reader.index], dtype=torch.long).to(self.device)
        self.counts = torch.zeros(len(self.files), dtype=torch.float32, device=self.device)
        self.first = torch.full((len(self.files),), self.none, dtype=torch.long, device=self.device)
        self.reported: dict[str, str] = {}  # shard file -> where in it (host), warned once

    def note(self, batch: dict[str, Any], sequence: torch.Tensor) -> None:
        """Count ``batch``'s non-finite states by shard; ``sequence (B, T)``: each token's sequence
        index. Device work only."""
        bad = None
        for key in ("aux_hidden_states", "final_hidden_states"):
            x = batch.get(key)
            if isinstance(x, torch.Tensor) and x.is_floating_point():
                b = x.isfinite().all(-1).logical_not()
                bad = b if bad is None else bad.logical_or(b)
        if bad is None:
            return
        mask = batch.get("attention_mask")
        if isinstance(mask, torch.Tensor):
            bad = bad.logical_and(mask.bool())
        sequence, bad = sequence.reshape(-1), bad.reshape(-1)
        shard = self.shard_of.index_select(0, sequence)
        self.counts.index_add_(0, shard, bad.float())
        self.first.scatter_reduce_(0, shard, sequence.masked_fill(bad.logical_not(), self.none), "amin")

    def values(self, dtype: torch.dtype) -> torch.Tensor:
        """``[counts, first]`` as one device tensor of ``dtype`` (read with the metrics)."""
        return torch.cat([self.counts.to(dtype), self.first.to(dtype)])

    def where(self, sequence: int) -> str:
        """``file (sequence k of the shard, id 'x')`` of global sequence index ``sequence``."""
        f = self.reader.index[sequence][0]
        k = sequence - self.start[f]
        ids = self.reader.manifest["shards"][self.files.index(f)].get("ids") or []
        rid = f", id {ids[k]!r}" if k < len(ids) else ""
        return f"{self.reader.dir / f} (sequence {k} of the shard{rid})"

    def absorb(self, values: list[float], state: Any) -> None:
        """Warn once per shard newly seen with non-finite states (``values``: :meth:`values` on
        the host), noting it in ``state.nonfinite_shards``."""
        n = len(self.files)
        for k in range(n):
            if values[k] > 0 and self.files[k] not in self.reported:
                where = self.where(int(values[n + k]))
                self.reported[self.files[k]] = where
                state.nonfinite_shards[self.files[k]] = where
                log.warning("non-finite hidden states in %s: the optimizer steps of batches holding it are skipped; "
                            "%s", where, recompute_hint(self.reader.dir, verify=True))

    def cause(self, accelerator: Any = None) -> str | None:
        """The lowest-numbered shard with non-finite states seen (every process's, when
        ``accelerator`` is given: a collective), as a clause naming it and the fix; None if none."""
        counts, first = self.counts.clone(), self.first.clone()
        if accelerator is not None and accelerator.num_processes > 1:
            import torch.distributed as dist

            dist.all_reduce(counts, op=dist.ReduceOp.SUM)
            dist.all_reduce(first, op=dist.ReduceOp.MIN)
        host_counts, host_first = counts.tolist(), first.tolist()
        bad = [k for k, c in enumerate(host_counts) if c > 0]
        if bad:
            where = self.where(int(host_first[bad[0]]))
        elif self.reported:
            where = self.reported[min(self.reported)]
        else:
            return None
        return f"first shard with non-finite hidden states: {where}; {recompute_hint(self.reader.dir, verify=True)}"
