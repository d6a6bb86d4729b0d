"""Per-sequence scores of the target's distributions, for data selection (``data.select``).

Following SFDD (Fan et al., "Flatter Tokens are More Valuable for Speculative Draft Model
Training", arXiv:2601.18902): the draft learns most from positions where the target's next-token
distribution is flat, little where it is one sharp peak. Two scores per sequence, both over the
draft vocab (the ``t2d`` rows of the target ``lm_head`` applied to the target's final, normed
hidden state: ``p = softmax(final @ W[t2d].T)``) and averaged over the sequence's *trained*
positions (position s, whose distribution is over token x_{s+1}, counts when ``loss_mask[s+1]``):

- ``entropy``: ``H(p) = -sum_v p_v log p_v`` in nats (0: one token; ``log Vd``: uniform).
- ``flatness``: SFDD's flatness, the cosine similarity of p with the uniform distribution u over
  the draft vocab, ``cos(p, u) = 1 / (sqrt(Vd) * ||p||_2)`` (1: uniform; ``1/sqrt(Vd)``: one
  token). The authors' code ranks by ``1 - cos(p, u)`` and keeps the smallest; keeping the
  largest ``cos(p, u)`` is the same order. Their code scores the full target vocab and whole
  batches; here it is the draft vocab (what the draft is distilled on) and one sequence.

Higher is flatter for both; :func:`select_top` keeps the highest. A sequence with no trained
position has no score (``None``) and is kept last.

Where the scores live: captured shards carry them in their manifest entry
(``"scores": {"vocab": ..., "entropy": [...], "flatness": [...]}``, in the order of the entry's
``ids``), written at capture by :class:`SequenceScorer`. Shards captured before scores existed
(or under another draft vocab) get them from :func:`score_shards`, which reads the stored final
states and writes ``hidden_states/scores.json`` beside the manifest (atomic, after every shard,
so a killed run resumes); :func:`read_scores` merges both. Command line:
``python -m draftsmith.cli.hidden_states score RUN_DIR``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from ..fileio import ShardError, atomic_write_bytes

log = logging.getLogger(__name__)

SCORES = ("entropy", "flatness")
SCORES_FILE = "scores.json"
SCORE_CHUNK_ELEMENTS = 1 << 24  # fp32 logits elements per chunk: 64 MiB


def vocab_key(d2t: torch.Tensor) -> str:
    """A short fingerprint of the draft vocab ``d2t (Vd,)``: scores are valid for that vocab only."""
    return hashlib.sha256(d2t.to(torch.int64).cpu().numpy().tobytes()).hexdigest()[:16]


def scored_positions(loss_mask: torch.Tensor) -> torch.Tensor:
    """``(T,)`` bool: positions s whose target distribution (over x_{s+1}) is trained,
    ``loss_mask[s + 1] == 1``; the last position never is. ``loss_mask``: ``(T,)``."""
    out = torch.zeros(loss_mask.shape, dtype=torch.bool, device=loss_mask.device)
    out[:-1] = loss_mask[1:].bool()
    return out


def token_scores(final: torch.Tensor, weight: torch.Tensor,
                 chunk_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Entropy (nats) and flatness ``cos(p, u)`` of ``p = softmax(final @ weight.T)`` per row.

    Chunked: one ``(C, Vd)`` fp32 tensor at a time (``chunk_rows`` or as many rows as keep it at
    :data:`SCORE_CHUNK_ELEMENTS`). On an accelerator a bf16 ``weight`` multiplies in bf16 (the
    logits the served target computes); on the CPU, or for an fp32 weight, in fp32.

    Args:
        final: ``(N, H)`` the target's final (normed) hidden states, any float dtype.
        weight: ``(Vd, H)`` the draft-vocab rows of the target ``lm_head``.

    Returns:
        ``(entropy (N,), flatness (N,))`` float32 on ``final``'s device.
    """
    Vd = weight.shape[0]
    rows = max(1, chunk_rows or SCORE_CHUNK_ELEMENTS // max(1, Vd))
    low = weight.dtype != torch.float32 and weight.device.type != "cpu"
    w = weight if low or weight.dtype == torch.float32 else weight.float()
    ent, flat = [], []
    for a in range(0, final.shape[0], rows):
        x = final[a:a + rows].to(w.dtype)
        logp = torch.log_softmax(F.linear(x, w).float(), dim=-1)
        p = logp.exp()
        ent.append(-(p * logp).sum(-1))
        flat.append(1.0 / (math.sqrt(Vd) * torch.linalg.vector_norm(p, dim=-1)))
    if not ent:
        empty = final.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat(ent), torch.cat(flat)


def sequence_scores(final: torch.Tensor, loss_mask: torch.Tensor, weight: torch.Tensor,
                    chunk_rows: int | None = None) -> torch.Tensor:
    """``(len(SCORES),)`` float32: each score's mean over the trained positions of one sequence
    (:func:`scored_positions`), NaN when it has none. Every row is scored and the untrained ones
    weighted 0 (a boolean gather would read its size back from the device): no host read, the
    caller converts.

    Args:
        final: ``(T, H)``; loss_mask: ``(T,)`` (on any device); weight: ``(Vd, H)``.
    """
    sel = scored_positions(torch.as_tensor(loss_mask).to(final.device)).float()
    ent, flat = token_scores(final, weight.to(final.device), chunk_rows)
    return torch.stack([ent, flat]) @ sel / sel.sum()  # 0 / 0 = NaN without a trained position


class SequenceScorer:
    """``scorer(final (T, H), loss_mask (T,)) -> (len(SCORES),)`` tensor on ``final``'s device
    (:func:`sequence_scores`); the head rows are loaded by ``load_weight()`` on the first call and
    kept, once per device (the capture engines yield on one device).

    Attributes:
        vocab: :func:`vocab_key` of the draft vocab the weight rows are of.
    """

    def __init__(self, load_weight: Callable[[], torch.Tensor], vocab: str, chunk_rows: int | None = None):
        self._load, self.vocab, self.chunk_rows = load_weight, vocab, chunk_rows
        self._weights: dict[torch.device, torch.Tensor] = {}

    @classmethod
    def for_target(cls, target_dir: Path, vocab_file: Path) -> "SequenceScorer | None":
        """The scorer of the target checkpoint at ``target_dir`` over the draft vocab in
        ``vocab_file`` (``vocab.safetensors``); None (nothing is scored) when that file is missing."""
        from safetensors.torch import load_file

        from ..target import load_target_head_tensors

        if not Path(vocab_file).is_file():
            return None
        vocab = load_file(str(vocab_file))

        def load() -> torch.Tensor:
            return load_target_head_tensors(Path(target_dir))["lm_head"][vocab["t2d"]]

        return cls(load, vocab_key(vocab["d2t"]))

    def weight(self, device: torch.device) -> torch.Tensor:
        """The head rows on ``device`` (fp32 on the CPU: converted once, not per call)."""
        w = self._weights.get(device)
        if w is None:
            w = self._load() if not self._weights else next(iter(self._weights.values()))
            w = w.to(device=device, dtype=torch.float32 if device.type == "cpu" else w.dtype)
            self._weights[device] = w
        return w

    def __call__(self, final: torch.Tensor, loss_mask: Any) -> torch.Tensor:
        return sequence_scores(final, torch.as_tensor(loss_mask), self.weight(final.device), self.chunk_rows)


def scores_entry(vocab: str, rows: list[torch.Tensor]) -> dict:
    """The manifest entry's ``"scores"`` for one shard: ``rows`` (one :class:`SequenceScorer`
    result per sequence, in the entry's ``ids`` order) as lists of floats (None for NaN)."""
    values = torch.stack(rows).cpu().tolist() if rows else []
    out: dict[str, Any] = {"vocab": vocab}
    for k, name in enumerate(SCORES):
        out[name] = [None if math.isnan(v[k]) else round(v[k], 6) for v in values]
    return out


def _read_sidecar(directory: Path) -> dict:
    path = Path(directory) / SCORES_FILE
    if not path.is_file():
        return {"shards": {}}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ShardError(f"{path}: unreadable ({exc}); delete it and compute the scores again") from None
    return data if isinstance(data.get("shards"), dict) else {"shards": {}}


def _shard_scores(entry: dict, sidecar: dict, vocab: str) -> dict | None:
    """The scores of one manifest ``entry`` for the draft vocab ``vocab``: its own, else the
    sidecar's when they were computed from this very file (same sha256); None when neither."""
    own = entry.get("scores")
    if isinstance(own, dict) and own.get("vocab") == vocab:
        return own
    side = sidecar["shards"].get(entry["file"])
    if isinstance(side, dict) and side.get("vocab") == vocab and side.get("sha256") == entry.get("sha256"):
        return side
    return None


def read_scores(directory: Path, vocab: str) -> dict[str, list[float | None]] | None:
    """Every score of every sequence of the shard directory, in manifest order (the order
    :class:`~draftsmith.data_prep.shards.ShardReader` numbers the sequences); None when some
    shard has no scores for the draft vocab ``vocab`` (:func:`vocab_key`).

    Raises:
        ShardError: no manifest, or an unreadable ``scores.json``.
    """
    from .shards import load_manifest

    manifest = load_manifest(Path(directory))
    if manifest is None:
        raise ShardError(f"{directory}: no manifest.json; run the hidden-states stage first")
    sidecar = _read_sidecar(directory)
    out: dict[str, list] = {name: [] for name in SCORES}
    for entry in sorted(manifest["shards"], key=lambda s: s["index"]):
        got = _shard_scores(entry, sidecar, vocab)
        if got is None or any(len(got.get(n) or []) != entry["num_sequences"] for n in SCORES):
            return None
        for name in SCORES:
            out[name].extend(got[name])
    return out


def score_shards(directory: Path, scorer: SequenceScorer, device: str | torch.device = "cpu",
                 progress: bool = True) -> dict:
    """Compute the scores of every shard of ``directory`` that has none for ``scorer.vocab``,
    from its stored final hidden states, into ``directory/scores.json`` (rewritten atomically after
    each shard: a killed run keeps what it finished and resumes with the next shard).

    Returns:
        ``{"shards": total, "scored": computed now, "sequences": total sequences}``.

    Raises:
        ShardError: the shard directory is incomplete or a shard is damaged (its file named).
    """
    from tqdm.auto import tqdm

    from .shards import ShardReader

    directory = Path(directory)
    reader = ShardReader(directory, decode_dtype=torch.float32)
    sidecar = _read_sidecar(directory)
    sidecar = sidecar if sidecar.get("format") == 1 else {"format": 1, "shards": {}}
    entries = sorted(reader.manifest["shards"], key=lambda s: s["index"])
    todo = [e for e in entries if _shard_scores(e, sidecar, scorer.vocab) is None]
    log.info("scores: %d of %d shards already scored; computing %d", len(entries) - len(todo), len(entries), len(todo))
    by_file: dict[str, list[tuple[int, int]]] = {}
    for file, a, b in reader.index:
        by_file.setdefault(file, []).append((a, b))
    device = torch.device(device)
    for entry in tqdm(todo, desc="scores", unit="shard", disable=not progress):
        fh = reader._fh(entry["file"])
        rows = []
        for a, b in by_file[entry["file"]]:
            final = reader._states(fh, "final_hidden_states", a, b).to(device)
            rows.append(scorer(final, fh.get_slice("loss_mask")[a:b]))
        sidecar["shards"][entry["file"]] = dict(scores_entry(scorer.vocab, rows), sha256=entry.get("sha256"))
        atomic_write_bytes(directory / SCORES_FILE, json.dumps(sidecar).encode())
    return {"shards": len(entries), "scored": len(todo), "sequences": len(reader)}


def select_top(indices: list[int], scores: list[float | None], keep_fraction: float) -> list[int]:
    """The ``max(1, round(keep_fraction * len(indices)))`` of ``indices`` with the highest
    ``scores[i]`` (ties: the lower index first; no score: last), returned in ascending order.
    Deterministic: depends on the scores alone.

    Raises:
        ValueError: ``keep_fraction`` outside (0, 1].
    """
    if not 0 < keep_fraction <= 1:
        raise ValueError(f"data.select.keep_fraction={keep_fraction}: must be in (0, 1]")
    if keep_fraction == 1 or not indices:
        return list(indices)
    k = max(1, round(keep_fraction * len(indices)))
    order = sorted(indices, key=lambda i: (scores[i] is None, -(scores[i] or 0.0), i))
    return sorted(order[:k])
