"""``speculation_profile.json``: a draft's measured acceptance profile, kept beside its export.

The fields follow NVIDIA Model-Optimizer's proposal for a portable profile (schema version
``1.0``; docs/speculation_profile.md lists every field, its unit and where draftsmith adds to
it): per-position conditional and marginal acceptance, the mean acceptance length (AL) and the
acceptance-length histogram, K, the draft's ``max_supported_k`` and the measurement conditions,
so that a throughput model (Dynamo's planner) can read what the draft does instead of assuming.

Everything is derived from vLLM's spec-decode counters (docs/conventions.md, "Acceptance
metrics"): ``D`` drafts (verify steps of one request), ``A`` accepted draft tokens and
``a[i]``, the drafts whose position ``i`` (0-based) was accepted. vLLM accepts the longest
correct prefix of a draft, so ``a[i]`` counts the drafts that accepted at least ``i + 1``
tokens, and:

- marginal ``[i]`` = ``a[i] / D``: P(the first ``i + 1`` draft tokens are accepted);
- conditional ``[i]`` = ``a[i] / a[i-1]`` (``a[-1] = D``): P(position ``i`` accepted | every
  earlier one was);
- histogram: ``a[n-1] - a[n]`` drafts accepted exactly ``n`` tokens (``a[-1] = D``,
  ``a[K] = 0``), keyed by acceptance length ``n + 1`` (the bonus token counted), exact;
- AL = ``1 + A / D`` = ``1 + sum(marginal)``, per verify step.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ..fileio import atomic_file
from ..layout import DraftLoadError
from ..methods import UnknownMethodError, get_method, method_of_export

SCHEMA_VERSION = "1.0"
PROFILE_FILE = "speculation_profile.json"
WEIGHTS_FILE = "model.safetensors"
"""The export's weights file whose sha256 a profile records (``draft_checkpoint.weights_sha256``)."""
_CHUNK = 1 << 20  # hash 1 MiB at a time: a draft's weights need not fit in memory
_SHA256 = re.compile(r"[0-9a-f]{64}")
PRODUCER = "draftsmith acceptance"
# vLLM's own proposers (no draft method of ours) whose K=n draft is the first n tokens of their K=n+1
# draft; a registered method says so itself (DraftMethodSpec.chain_drafts)
CHAIN_PROPOSERS = frozenset({"ngram"})

Rate = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]


class ProfileError(ValueError):
    """A profile that cannot be built, read or validated; one line naming the file and key."""


class ProfileCounts(BaseModel):
    """The counter values the vectors are ratios of (draftsmith's addition to the proposal)."""

    model_config = ConfigDict(extra="forbid")

    num_drafts: int = Field(ge=0, description="D: verify steps that carried a draft (marginal denominator)")
    num_draft_tokens: int | None = Field(None, ge=0, description="proposed draft tokens")
    num_accepted_tokens: int = Field(ge=0, description="A: accepted draft tokens")
    accepted_per_position: list[int] = Field(description="a[i]: drafts with position i accepted (numerators)")
    reached_per_position: list[int] = Field(description="drafts with every position before i accepted "
                                            "(conditional denominators: D, a[0], ..., a[K-2])")


class SpeculationProfile(BaseModel):
    """A ``speculation_profile.json`` read back. Fields another producer adds are kept."""

    model_config = ConfigDict(extra="allow")

    schema_version: str
    measured: bool
    producer: str | None = None
    method: str | None = None
    draft_checkpoint: dict[str, Any] | None = None
    target_model: dict[str, Any] | None = None
    num_speculative_tokens: int = Field(ge=1)
    block_size: int | None = None
    max_supported_k: int | None = Field(None, ge=1)
    max_supported_k_source: str | None = None
    verification_method: str = "longest_prefix"
    conditional_accept_rates: list[Rate]
    marginal_accept_rates: list[Rate]
    mean_accept_length: float | None = Field(allow_inf_nan=False)
    mean_accept_length_per_request: float | None = None
    accept_length_model: str | None = None
    accept_length_by_k: dict[str, float] | None = None
    acceptance_length_histogram: dict[int, Annotated[int, Field(ge=0)]]
    per_category: dict[str, Any] | None = None
    measurement_conditions: dict[str, Any]
    counts: ProfileCounts | None = None
    validation: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _consistent(self) -> SpeculationProfile:
        k = self.num_speculative_tokens
        if self.schema_version.split(".")[0] != SCHEMA_VERSION.split(".")[0]:
            raise ValueError(f"schema_version: {self.schema_version!r}, this draftsmith reads {SCHEMA_VERSION[0]}.x")
        for key in ("conditional_accept_rates", "marginal_accept_rates"):
            if len(getattr(self, key)) != k:
                raise ValueError(f"{key}: {len(getattr(self, key))} entries, num_speculative_tokens is {k}")
        bad = [n for n in self.acceptance_length_histogram if not 1 <= n <= k + 1]
        if bad:
            raise ValueError(f"acceptance_length_histogram: lengths {bad} outside 1..{k + 1}")
        sha = (self.draft_checkpoint or {}).get("weights_sha256")
        if sha is not None and not (isinstance(sha, str) and _SHA256.fullmatch(sha)):
            raise ValueError(f"draft_checkpoint.weights_sha256: {sha!r} is not a sha256 (64 lowercase hex digits)")
        al = self.mean_accept_length
        if al is None and self.measured:
            raise ValueError("mean_accept_length: null in a measured profile")
        if al is not None and not 1.0 <= al <= k + 1:
            raise ValueError(f"mean_accept_length: {al} outside [1, {k + 1}]")
        return self


def acceptance_counts(drafts: int, per_pos: list[int], draft_tokens: int | None = None,
                      accepted: int | None = None) -> ProfileCounts:
    """The counts of one measurement from vLLM's counters (``per_pos``: accepted tokens per draft
    position, K long).

    Raises:
        ProfileError: ``per_pos`` increasing with the position, or above ``drafts`` (not vLLM's
            longest-prefix count).
    """
    per_pos = [int(n) for n in per_pos]
    reached = [int(drafts), *per_pos[:-1]]
    if any(a > r for a, r in zip(per_pos, reached)):
        raise ProfileError(f"counters.per_pos: {per_pos} exceeds the drafts reaching each position {reached} "
                           "(not a longest-prefix count)")
    return ProfileCounts(num_drafts=drafts, num_draft_tokens=draft_tokens,
                         num_accepted_tokens=sum(per_pos) if accepted is None else accepted,
                         accepted_per_position=per_pos, reached_per_position=reached)


def acceptance_vectors(counts: ProfileCounts) -> tuple[list[float], list[float]]:
    """``(conditional, marginal)`` acceptance per draft position (0 where nothing reached it)."""
    d = counts.num_drafts
    conditional = [a / r if r else 0.0 for a, r in zip(counts.accepted_per_position, counts.reached_per_position)]
    marginal = [a / d if d else 0.0 for a in counts.accepted_per_position]
    return conditional, marginal


def length_histogram(counts: ProfileCounts) -> dict[int, int]:
    """Drafts per acceptance length ``n + 1`` (``n`` accepted draft tokens plus the bonus token),
    every length from 1 to K + 1."""
    survival = [*counts.reached_per_position, counts.accepted_per_position[-1], 0]
    return {n + 1: survival[n] - survival[n + 1] for n in range(len(counts.accepted_per_position) + 1)}


def public_name(name: str | Path | None) -> str | None:
    """A name fit for a published file: a Hub id or ``builtin:`` name as given, a local path by
    its last two parts (no absolute path of this machine leaves it)."""
    parts = [p for p in str(name or "").replace("\\", "/").split("/") if p not in ("", ".")]
    return "/".join(parts[-2:]) or None


def chain_drafts(method: str | None) -> bool:
    """Whether ``method``'s K = n draft is the first n tokens of its K = n + 1 draft, so one
    measurement gives the acceptance length of every smaller K (a profile's ``accept_length_model``
    ``chain_analytic``); block and parallel drafters (DFlash, DSpark, P-EAGLE) plan all K slots
    together, so each K is its own measurement (``measured_per_k``). ``method``: a registered draft
    method (its spec's ``chain_drafts``) or one of vLLM's proposers (:data:`CHAIN_PROPOSERS`); an
    unknown one is not a chain."""
    if method in CHAIN_PROPOSERS:
        return True
    try:
        return bool(get_method(method).chain_drafts) if method else False
    except UnknownMethodError:
        return False


def prompts_sha256(conversations: list[Any]) -> str:
    """SHA-256 (hex) of the conversations sent, as canonical JSON (sorted keys, UTF-8)."""
    text = json.dumps(conversations, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def max_supported_k(draft_config: dict[str, Any] | None) -> tuple[int | None, str | None]:
    """The most draft tokens the export was trained or exported to propose, and where it came
    from: P-EAGLE's trained depths, EAGLE-3's TTT steps, else the export's own K (DFlash
    ``block_size - 1``, DSpark ``block_size``, Medusa heads, MLP speculator stages). ``(None,
    None)``: no draft config, or one no registered method recognises."""
    if not draft_config:
        return None, None
    try:
        spec = method_of_export(draft_config)
        fit = spec.format.fit(draft_config) if spec.format.fit is not None else None
    except (UnknownMethodError, DraftLoadError):
        return None, None
    if fit is not None and fit.max_speculative_tokens:
        return int(fit.max_speculative_tokens), "trained depths (num_depths)"
    ttt = (draft_config.get("draftsmith") or {}).get("ttt_steps")
    if isinstance(ttt, int) and ttt > 0:
        return ttt, "trained TTT steps"
    k = spec.format.card.num_speculative_tokens(draft_config)
    return (int(k), "the export's num_speculative_tokens") if k else (None, None)


def file_sha256(path: Path) -> str:
    """SHA-256 (hex) of the file at ``path``, read 1 MiB at a time.

    Raises:
        OSError: the file cannot be read.
    """
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def profile_binding(prof: SpeculationProfile) -> tuple[str | None, str | None]:
    """``(weights sha256, method)`` a profile says it measured (None where it records none)."""
    ckpt = prof.draft_checkpoint or {}
    return ckpt.get("weights_sha256"), prof.method or ckpt.get("method")


def _short(sha: str | None) -> str:
    return sha[:12] if sha else "not recorded"


def binding_mismatch(prof: SpeculationProfile, weights: Path, weights_sha256: str, method: str) -> str | None:
    """Why ``prof`` cannot be shown to describe the export whose weights file ``weights`` hashes
    to ``weights_sha256`` and whose method is ``method``, in words fit for one line; None when
    the profile records that very sha256 and method. A profile that records no sha256 (an
    older draftsmith's, another producer's) cannot be shown to match."""
    sha, measured = profile_binding(prof)
    if sha == weights_sha256 and measured == method:
        return None
    return (f"it measured weights sha256 {_short(sha)}, method {measured or 'not recorded'}, but {weights} is "
            f"sha256 {_short(weights_sha256)}, method {method}")


def build_profile(result: dict[str, Any], target: str | Path, draft: str | Path | None = None,
                  draft_config: dict[str, Any] | None = None,
                  engine: dict[str, Any] | None = None) -> SpeculationProfile:
    """The profile of one ``draftsmith acceptance`` measurement (a result of
    :func:`draftsmith.eval.acceptance.measure`, its ``counters`` in particular).

    Args:
        target / draft: what was measured (published by :func:`public_name`). When ``draft`` is
            an export folder holding :data:`WEIGHTS_FILE`, the profile is bound to those weights:
            ``draft_checkpoint.weights_sha256`` is their sha256, hashed here (where the profile is
            written), so that ``draftsmith export`` and ``draftsmith hub`` can tell a profile of
            other weights (:func:`binding_mismatch`).
        draft_config: the export's ``config.json`` (``max_supported_k``, ``block_size``).
        engine: the vLLM engine settings (``dtype``, ``max_num_seqs``, ...).

    A measurement without drafts (``num_drafts`` 0 or no counters) gives ``measured: false``
    with zero vectors and no AL, as the proposal marks an unmeasured profile.

    Raises:
        ProfileError: no K (``num_speculative_tokens`` 0: no speculation), or counters that are
            not vLLM's longest-prefix counts.
        OSError: the draft's weights file cannot be read.
    """
    k = int(result.get("num_speculative_tokens") or 0)
    method = result.get("method")
    if k < 1:
        raise ProfileError(f"num_speculative_tokens: {k} (method {method!r} did not speculate)")
    raw = result.get("counters") or {}
    per_pos = [int(n) for n in raw.get("per_pos") or []][:k]
    per_pos += [0] * (k - len(per_pos))  # no per-position counter: nothing accepted anywhere
    counts = acceptance_counts(int(raw.get("drafts") or 0), per_pos, raw.get("draft_tokens"), raw.get("accepted_tokens"))
    conditional, marginal = acceptance_vectors(counts)
    measured = counts.num_drafts > 0
    al = 1 + counts.num_accepted_tokens / counts.num_drafts if measured else None
    most, source = max_supported_k(draft_config)
    if most is None:
        most, source = k, "the measured K (the export records none)"
    engine, block = engine or {}, (draft_config or {}).get("block_size")
    conditions = {
        "engine": "vllm (offline LLM.chat, spec-decode counters)",
        "vllm_version": result.get("vllm_version"),
        "device": result.get("device"),
        "dtype": engine.get("dtype"),
        "enforce_eager": engine.get("enforce_eager"),
        "tensor_parallel_size": engine.get("tensor_parallel_size"),
        "concurrency": "every prompt submitted at once, batched by the engine",
        "max_num_seqs": engine.get("max_num_seqs"),
        "temperature": result.get("temperature"),
        "draft_sampling": result.get("draft_sampling"),
        "max_new_tokens": result.get("max_new_tokens"),
        "seed": result.get("seed"),
        "measured_at": result.get("measured_at"),
        "prompts": {"source": public_name(result.get("prompts")), "count": result.get("num_prompts"),
                    "sha256": result.get("prompts_sha256"), "tokens": result.get("prompt_tokens")},
        "output_tokens": result.get("output_tokens"),
    }
    groups = result.get("groups") or {}
    full = counts.num_drafts * k
    checkpoint = {"name_or_path": public_name(draft), "method": method} if draft else None
    if checkpoint is not None and (Path(draft) / WEIGHTS_FILE).is_file():
        checkpoint.update(weights_file=WEIGHTS_FILE, weights_sha256=file_sha256(Path(draft) / WEIGHTS_FILE))
    profile = {
        "schema_version": SCHEMA_VERSION, "measured": measured, "producer": PRODUCER, "method": method,
        "draft_checkpoint": checkpoint,
        "target_model": {"name_or_path": public_name(target)},
        "num_speculative_tokens": k,
        "block_size": block if isinstance(block, int) else None,
        "max_supported_k": most, "max_supported_k_source": source,
        "verification_method": "longest_prefix",
        "conditional_accept_rates": [round(x, 6) for x in conditional],
        "marginal_accept_rates": [round(x, 6) for x in marginal],
        "mean_accept_length": None if al is None else round(al, 6),
        "mean_accept_length_per_request": None,  # the counters pool verify steps over requests
        "accept_length_model": "chain_analytic" if chain_drafts(method) else "measured_per_k",
        "accept_length_by_k": {str(k): round(al, 6)} if al is not None else {},
        "acceptance_length_histogram": length_histogram(counts),
        "per_category": {name: {"mean_accept_length": g.get("mean_acceptance_length"), "num_drafts": g.get("num_drafts"),
                                "num_prompts": g.get("num_prompts")} for name, g in groups.items()} or None,
        "measurement_conditions": conditions,
        "counts": counts.model_dump(),
        "validation": None if not measured else {
            "mean_consistency": _mean_consistency(al, marginal),
            "marginal_monotonicity": {"passed": all(b <= a for a, b in zip(marginal, marginal[1:]))},
            "full_length_drafts": {"passed": counts.num_draft_tokens in (None, full),
                                   "missing_draft_tokens": None if counts.num_draft_tokens is None
                                   else full - counts.num_draft_tokens},
        },
    }
    return SpeculationProfile.model_validate(profile)


def _mean_consistency(al: float, marginal: list[float], tolerance: float = 1e-6) -> dict[str, Any]:
    """AL against ``1 + sum(marginal)``: equal when the accepted counter is the sum of the
    per-position ones (vLLM counts both from the same accepted prefixes)."""
    implied = 1.0 + sum(marginal)
    return {"implied_mean_accept_length": round(implied, 6), "reported_mean_accept_length": round(al, 6),
            "abs_delta": round(abs(implied - al), 9), "tolerance": tolerance, "passed": abs(implied - al) <= tolerance}


def write_profile(path: Path, profile: SpeculationProfile) -> Path:
    """Write ``profile`` as JSON (indented, the proposal's key order) to ``path`` atomically;
    a directory gets :data:`PROFILE_FILE` inside it. Returns the file written.

    Raises:
        OSError: the file cannot be written (DiskFullError on a full disk).
    """
    path = Path(path)
    if path.is_dir():
        path = path / PROFILE_FILE
    text = json.dumps(profile.model_dump(mode="json"), indent=1, allow_nan=False) + "\n"
    with atomic_file(path) as fh:
        fh.write(text.encode())
    return path


def read_profile(path: Path) -> SpeculationProfile:
    """Read and validate a ``speculation_profile.json`` (schema version 1.x: the required
    fields, K-long vectors of rates in [0, 1], histogram lengths in 1..K+1, AL in [1, K+1]).

    Raises:
        ProfileError: unreadable, not JSON, or not that schema; one line naming ``path`` and
            the first bad key.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ProfileError(f"{path}: cannot read the speculation profile ({type(exc).__name__}: {exc})") from None
    if not isinstance(data, dict):
        raise ProfileError(f"{path}: a speculation profile is a JSON object, not {type(data).__name__}")
    try:
        return SpeculationProfile.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        key = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        raise ProfileError(f"{path}: {key or 'profile'}: {msg}" if key else f"{path}: {msg}") from None
