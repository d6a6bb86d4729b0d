"""Hugging Face Hub export: a Hub-ready folder (vLLM-loadable draft + model card), optionally pushed.

    draftsmith hub DRAFT_DIR --out HUB_DIR --repo-id USER/NAME \
        [--recipe RUN/recipe.yaml] [--acceptance RUN/eval_mtbench.json] [--serve RUN/serve/results.json] \
        [--license LICENSE] [--push [--private]]

``DRAFT_DIR`` is a ``draftsmith export`` output (EAGLE-3 speculators or legacy format, Medusa, MLP
speculator). The folder gets a copy of its files and a ``README.md`` model card: YAML front
matter (``base_model`` = the target, ``license``, ``datasets`` = the recipe's Hub dataset
sources, ``library_name``, ``tags``), the draft's method (any registered in :mod:`draftsmith.methods`) and its shape, the training data
(from the run's ``recipe.yaml``), measured acceptance (``draftsmith acceptance --out`` JSON), the
speculation profile (the ``speculation_profile.json`` ``draftsmith acceptance`` writes into
``DRAFT_DIR``, copied into the folder and pushed with it, only when it records the sha256 and
method of ``DRAFT_DIR``'s own weights) and serving speedup (``draftsmith
serve-bench``'s ``results.json``) with the commands that produced them, and the ``vllm serve`` line.

Pushing uses ``huggingface_hub``: ``create_repo(repo_id, private=..., exist_ok=True)`` then
``upload_folder``. The token comes from ``HF_TOKEN`` or the standard login (``hf auth login``);
it is passed to the client only, never printed or written.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import yaml

from .profile import (PROFILE_FILE, WEIGHTS_FILE, ProfileError, SpeculationProfile, binding_mismatch, file_sha256,
                      read_profile)
from .results import AcceptanceResult, ServeResults, read_acceptance
from .serving_plan import PLAN_FILE
from ..methods import DraftMethodSpec, UnknownMethodError, method_of_export
from ..vllm_bridge import spec_config

log = logging.getLogger(__name__)
DRAFT_FILES = ("config.json", "model.safetensors", "generation_config.json", "speculators_config.json")
# Hub dataset ids look like "owner/name"; local files and builtin: sets are not listed in the card.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_DATA_SUFFIXES = (".json", ".jsonl", ".parquet", ".csv", ".txt")


class HubError(RuntimeError):
    """Preparing or pushing the Hub folder failed; the message names the folder or repo."""


def _method(cfg: dict[str, Any]) -> DraftMethodSpec:
    """The registered method of an exported draft's ``config.json``.

    Raises:
        HubError: no registered method (:mod:`draftsmith.methods`) recognises the export.
    """
    try:
        return method_of_export(cfg)
    except UnknownMethodError as exc:
        raise HubError(f"draft config.json: {exc}") from None


def _verifier(cfg: dict[str, Any], recipe: dict[str, Any] | None) -> str | None:
    """The target the draft was trained for: the export's record of it, else the recipe's (an
    embedded target by its Hub id)."""
    from ..target import verifier_name

    spec = cfg.get("speculators_config") or {}
    recorded = (spec.get("verifier") or {}).get("name_or_path") or (cfg.get("draftsmith") or {}).get("verifier")
    named = ((recipe or {}).get("target") or {}).get("name_or_path")
    return recorded or (verifier_name(named) if named else None)


def hub_datasets(recipe: dict[str, Any] | None) -> list[str]:
    """The Hub dataset ids among the recipe's ``data.sources`` (local files and ``builtin:`` sets
    have no Hub id and are named in the card's text only)."""
    out = []
    for source in ((recipe or {}).get("data") or {}).get("sources") or []:
        path = str(source.get("path", ""))
        if _HUB_ID.match(path) and not path.endswith(_DATA_SUFFIXES) and path not in out:
            out.append(path)
    return out


def target_license(target: str | None) -> str | None:
    """The ``license`` of the target's own model card when the target is a local directory."""
    readme = Path(target) / "README.md" if target else None
    if readme is None or not readme.is_file():
        return None
    parts = readme.read_text(errors="replace").split("---\n", 2)
    if len(parts) < 3 or parts[0].strip():
        return None
    try:
        front = yaml.safe_load(parts[1])
    except yaml.YAMLError:
        return None
    return front.get("license") if isinstance(front, dict) else None


def _training_section(recipe: dict[str, Any] | None) -> list[str]:
    if not recipe:
        return ["Not recorded (no `--recipe` given)."]
    data, train, draft = recipe.get("data", {}), recipe.get("train", {}), recipe.get("draft") or {}
    sources = ", ".join(f"`{s.get('path')}`" + (f" (first {s['max_rows']} rows)" if s.get("max_rows") else "")
                        for s in data.get("sources", []))
    regen = data.get("regenerate") or {}
    lines = [f"- data: {sources}"]
    if regen.get("enabled"):
        lines.append(f"- assistant replies regenerated by the target (self-distillation) at temperatures "
                     f"{regen.get('temperatures')}, up to {regen.get('max_new_tokens')} new tokens")
    ttt = f"TTT steps {draft['ttt_steps']}, gamma {draft.get('gamma')}; " if "ttt_steps" in draft else ""
    lines += [f"- max sequence length {data.get('max_length')} tokens; {ttt}lr {train.get('lr')}, "
              f"batch {train.get('batch_size')} x accumulation {train.get('grad_accum_steps')}; "
              + (f"{train['max_steps']} optimizer steps" if train.get("max_steps") else f"{train.get('epochs')} epochs")]
    return lines


def _acceptance_section(acc: dict[str, AcceptanceResult] | None, target: str) -> list[str]:
    if not acc:
        return []
    lines = ["### Acceptance (vLLM spec-decode counters)", "",
             "| method | K | temperature | prompts | acceptance length | acceptance rate | per position |",
             "|---|---|---|---|---|---|---|"]
    cmd = None
    for method, r in acc.items():
        if r.mean_acceptance_length is None:
            continue
        pp = " / ".join(f"{p:.2f}" for p in r.per_position_acceptance or [])
        rate = "—" if r.acceptance_rate is None else f"{r.acceptance_rate:.1%}"
        lines.append(f"| {method} | {r.num_speculative_tokens} | {r.temperature} | {r.num_prompts} "
                     f"(`{r.prompts}`) | {r.mean_acceptance_length:.2f} | {rate} | {pp} |")
        if method != "ngram" and cmd is None:
            cmd = (f"draftsmith acceptance --target {target} --draft DRAFT_DIR --method {method} "
                   f"--prompts {r.prompts} --k {r.num_speculative_tokens} --temperature {r.temperature}")
    lines += ["", "Acceptance length = 1 + accepted / drafts (counts the bonus token); rate = accepted / proposed.", ""]
    if cmd:
        lines += ["Command (reconstructed from the result file):", "", "```bash", cmd, "```", ""]
    return lines


def _profile_section(prof: SpeculationProfile | None) -> list[str]:
    """The measured speculation profile (``speculation_profile.json``): AL, K, temperature, vLLM,
    conditional and marginal acceptance per position, and how many drafts accepted n tokens."""
    if prof is None:
        return []
    cond = prof.measurement_conditions
    al = "—" if prof.mean_accept_length is None else f"{prof.mean_accept_length:.3f}"
    prompts = cond.get("prompts") or {}
    lines = [f"### Speculation profile (`{PROFILE_FILE}`)", "",
             f"AL {al} at K = {prof.num_speculative_tokens} (max supported K {prof.max_supported_k or '—'}), "
             f"temperature {cond.get('temperature', '—')}, {cond.get('vllm_version') or 'vLLM'}, "
             f"{prompts.get('count', '—')} prompts (`{prompts.get('source')}`)"
             + ("" if prof.measured else "; no drafts were measured") + ".", "",
             "| position | conditional | marginal | accepted / reached |", "|---|---|---|---|"]
    counts = prof.counts
    for i, (c, m) in enumerate(zip(prof.conditional_accept_rates, prof.marginal_accept_rates)):
        n = f"{counts.accepted_per_position[i]} / {counts.reached_per_position[i]}" if counts else "—"
        lines.append(f"| {i + 1} | {c:.3f} | {m:.3f} | {n} |")
    hist = prof.acceptance_length_histogram
    lines += ["", "Drafts by accepted tokens: " + ", ".join(f"{n - 1}: {hist.get(n, 0)}" for n in sorted(hist)) + ".",
              "Conditional = P(position accepted | every earlier one was); marginal = P(every position up to it "
              f"accepted); AL = 1 + accepted / drafts. Fields: the `{PROFILE_FILE}` in this repository.", ""]
    return lines


def _plan_section(plan: dict[str, Any] | None) -> list[str]:
    """The serving plan (``serving_plan.json``, ``draftsmith plan``): the K to serve per batch size
    and what it predicts (docs/serving_plan.md)."""
    if not plan:
        return []
    price = plan.get("price_per_hour")
    lines = [f"### Serving plan (`{PLAN_FILE}`)", "",
             f"K per batch size from the speculation profile and step costs measured on the serving machine "
             f"({(plan.get('sources') or {}).get('step_cost', 'source not recorded')}); predictions, not measurements.",
             "", "| batch size | K | predicted output tok/s | TPOT (ms) |" + (" $ per 1M output tokens |" if price else ""),
             "|---|---|---|---|" + ("---|" if price else "")]
    for b, row in sorted((plan.get("chosen") or {}).items(), key=lambda kv: int(kv[0])):
        cost = row.get("cost_per_1m_output_tokens")
        lines.append(f"| {b} | {row['k']} | {row['output_tok_s']:.1f} | {row['tpot_ms']:.1f} |"
                     + (f" {cost:.4f} |" if price and cost is not None else (" — |" if price else "")))
    spec = (plan.get("vllm") or {}).get("speculative_config")
    lines += ["", "Serve it with:" if spec else "Speculation did not pay at any measured batch size: serve without it.", ""]
    if spec:
        lines += ["```bash", f"vllm serve TARGET --speculative-config '{json.dumps(spec)}'", "```", ""]
    return lines


def _serve_section(serve: ServeResults | None) -> list[str]:
    if not serve:
        return []
    meta = serve.meta
    lines = ["### Serving speedup (vLLM OpenAI server, `vllm bench serve`)", "",
             f"Engine {meta.vllm_version}, {'eager' if meta.enforce_eager else 'compiled'}, "
             f"prompts `{meta.prompts}`, up to {meta.max_new_tokens} output tokens, temperature 0.", "",
             "| config | output tok/s (geomean) | vs baseline | speedup per concurrency | acceptance length |",
             "|---|---|---|---|---|"]
    for name, cfg in serve.configs.items():
        s = cfg.summary
        if cfg.status != "ok" or s is None or not s.geomean_output_tok_s:
            continue
        change = s.output_tok_s_change_vs_baseline_pct
        per = ", ".join(f"c={c}: {v:.2f}x" for c, v in (s.speedup_per_level or {}).items())
        al = s.acceptance.mean_acceptance_length if s.acceptance else None
        lines.append(f"| {name} | {s.geomean_output_tok_s:.1f} | {'—' if change is None else f'{change:+.1f}%'} | "
                     f"{per or '—'} | {'—' if al is None else f'{al:.2f}'} |")
    lines += ["", "Command:", "", "```bash", str(meta.command), "```", ""]
    return lines


def model_card(cfg: dict[str, Any], repo_id: str, recipe: dict[str, Any] | None = None,
               acceptance: dict[str, AcceptanceResult] | None = None, serve: ServeResults | None = None,
               card_license: str | None = None, profile: SpeculationProfile | None = None,
               plan: dict[str, Any] | None = None) -> str:
    """The ``README.md`` of the Hub folder: YAML front matter (``base_model`` = the target,
    ``license``, ``datasets``, ``library_name``, ``tags``) and Markdown for the draft's method.

    Args:
        card_license: the card's ``license``; default: the target's when it is a local directory whose
            model card names one, else ``other``.
        profile: the draft's ``speculation_profile.json``, shown as a table.
        plan: the draft's ``serving_plan.json`` (``draftsmith plan``), shown as a table.

    Raises:
        HubError: no registered method recognises ``cfg``.
    """
    spec = _method(cfg)
    card = spec.format.card
    target = _verifier(cfg, recipe) or "TARGET"
    k = card.num_speculative_tokens(cfg) or 3
    serve_spec = spec_config.for_export(spec, repo_id, k, ((recipe or {}).get("eval") or {}).get("draft_sampling", "greedy"))
    front: dict[str, Any] = {"base_model": target, "license": card_license or target_license(target) or "other"}
    datasets = hub_datasets(recipe)
    if datasets:
        front["datasets"] = datasets
    front["library_name"] = "vllm"
    front["tags"] = ["speculative-decoding", spec.name, *(["speculators"] if cfg.get("speculators_config") else []),
                     "draft-model", "draftsmith"]
    if spec.servable:
        use = ["```bash", f"vllm serve {target} --speculative-config '{json.dumps(serve_spec)}'", "```"]
    else:
        use = [f"vLLM's `{spec.vllm_method}` method loads this layout up to vLLM 0.32 "
               f"(`speculative_config` {json.dumps(serve_spec)}); draftsmith's reference decoder "
               "(`draftsmith spec-decode`) runs it with any version."]
    out = ["---", yaml.safe_dump(front, sort_keys=False).strip(), "---", "",
           f"# {card.title} draft for {target}", "",
           f"A speculative-decoding draft model, {card.summary}, for `{target}`, trained with draftsmith "
           f"and stored in the format vLLM loads for `method: {spec.vllm_method}`.", "",
           "## Use with vLLM", "", *use, "",
           "## Draft", "", *card.facts(cfg), f"- target (verifier): `{target}`", "",
           "## Training data", ""] + _training_section(recipe) + [""]
    measured = (_acceptance_section(acceptance, target) + _profile_section(profile) + _plan_section(plan)
                + _serve_section(serve))
    out += ["## Measured", ""] + (measured or ["No measurement was attached.", ""])
    return "\n".join(out)


def _read(path: Path | None, what: str, reader: Callable[[Path], Any]) -> Any:
    if path is None:
        return None
    try:
        return reader(Path(path))
    except (OSError, ValueError) as exc:  # ValueError: not JSON, or not the results schema
        raise HubError(f"{path}: cannot read the {what} ({exc})") from exc


def prepare_folder(draft: Path, out: Path, repo_id: str, recipe: Path | None = None, acceptance: Path | None = None,
                   serve: Path | None = None, card_license: str | None = None) -> Path:
    """Copy the exported draft (with its ``speculation_profile.json`` when ``draftsmith
    acceptance`` wrote one) into ``out`` and write the model card; returns ``out``. A draft file
    or profile ``out`` holds from an earlier run that ``draft`` lacks is removed (one logged line):
    it is not this draft's, and ``--push`` uploads the whole folder.

    Raises:
        HubError: ``draft`` is not an exported draft, an attached file is unreadable or not the
            schema of :mod:`draftsmith.eval.results`, or the draft's profile is not a valid
            speculation profile (:func:`draftsmith.eval.profile.read_profile`) or was not measured
            on this export's weights and method (:func:`check_profile_binding`); nothing is written.
    """
    if not Path(draft).is_dir():
        raise HubError(f"{draft}: no such directory; pass the folder `draftsmith export` wrote")
    cfg = _read(draft / "config.json", "draft config (run `draftsmith export` first)",
                lambda p: json.loads(p.read_text()))
    if not (draft / "model.safetensors").is_file():
        raise HubError(f"{draft / 'model.safetensors'} missing: not an exported draft")
    rec = None
    if recipe is not None:
        try:
            rec = yaml.safe_load(Path(recipe).read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise HubError(f"{recipe}: cannot read the recipe ({exc})") from exc
    prof = None
    if (draft / PROFILE_FILE).is_file():
        try:
            prof = read_profile(draft / PROFILE_FILE)
        except ProfileError as exc:
            raise HubError(str(exc)) from None
        check_profile_binding(draft, prof, _method(cfg).name)
    plan = _read(draft / PLAN_FILE, "serving plan", lambda p: json.loads(p.read_text())) \
        if (draft / PLAN_FILE).is_file() else None
    card = model_card(cfg, repo_id, rec, _read(acceptance, "acceptance result", read_acceptance),
                      _read(serve, "serving results", ServeResults.read), card_license, prof, plan)
    out.mkdir(parents=True, exist_ok=True)
    for name in (*DRAFT_FILES, PROFILE_FILE, PLAN_FILE):
        src, dst = draft / name, out / name
        if src.is_file():
            if not (dst.exists() and dst.samefile(src)):
                shutil.copy2(src, dst)
        elif dst.is_file():  # a copy an earlier `draftsmith hub` into this --out left: not this draft's
            dst.unlink()
            log.warning("removed %s: %s has no %s; the copy an earlier `draftsmith hub` left there is another "
                        "draft's and would be published as this one's", dst, draft, name)
    (out / "README.md").write_text(card)
    return out


def check_profile_binding(draft: Path, prof: SpeculationProfile, method: str) -> None:
    """Refuse to publish ``draft``'s ``speculation_profile.json`` unless it records the sha256 of
    ``draft``'s weights file and ``method`` (the export's, :func:`draftsmith.methods.method_of_export`):
    a profile of other weights, of another method (a DFlash profile in an EAGLE-3 export) or one
    without a sha256 (it cannot be shown to describe these weights) would be published as this
    draft's.

    Raises:
        HubError: one line naming the profile, the recorded and the export's sha256 and method, and
            the command that measures the export again.
    """
    weights = draft / WEIGHTS_FILE
    try:
        why = binding_mismatch(prof, weights, file_sha256(weights), method)
    except OSError as exc:
        raise HubError(f"{weights}: cannot read the weights to check the speculation profile against ({exc})") from None
    if why is not None:
        raise HubError(f"{draft / PROFILE_FILE}: not published: {why}; re-measure the export with `draftsmith "
                       f"acceptance --target TARGET --draft {draft}` (it rewrites the file), or delete it to publish the "
                       "draft without a profile")


def push(folder: Path, repo_id: str, private: bool = True, commit_message: str = "Upload speculative-decoding draft (draftsmith)") -> str:
    """Create ``repo_id`` if needed and upload ``folder``; returns the commit URL.

    Raises:
        HubError: no token (HF_TOKEN or ``hf auth login``), or the Hub refused (missing repo,
            no write access, network); the message names the repo and never holds the token.
    """
    from huggingface_hub import HfApi, get_token
    from huggingface_hub.errors import HfHubHTTPError

    token = get_token()
    if not token:
        raise HubError(f"no Hugging Face token to push {repo_id}: run `hf auth login` or set HF_TOKEN")
    api = HfApi(token=token)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        info = api.upload_folder(repo_id=repo_id, folder_path=str(folder), repo_type="model", commit_message=commit_message)
    except (HfHubHTTPError, OSError) as exc:
        raise HubError(f"pushing {folder} to {repo_id} failed: {type(exc).__name__}: "
                       f"{str(exc).replace(token, '***')}") from None
    return str(getattr(info, "commit_url", info))
