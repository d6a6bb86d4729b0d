"""Hugging Face Hub export: a Hub-ready folder (vLLM-loadable draft + model card), optionally pushed.

    python -m draftsmith.eval.hub DRAFT_DIR --out HUB_DIR --repo-id USER/NAME \
        [--recipe RUN/recipe.yaml] [--acceptance RUN/eval_mtbench.json] [--serve RUN/serve/results.json] \
        [--license LICENSE] [--push [--private]]

``DRAFT_DIR`` is an eval/export.py output (EAGLE-3 speculators or legacy format, Medusa, MLP
speculator). The folder gets a copy of its files and a ``README.md`` model card: YAML front
matter (``base_model`` = the target, ``license``, ``datasets`` = the recipe's Hub dataset
sources, ``library_name``, ``tags``), the draft's method (any registered in :mod:`draftsmith.methods`) and its shape, the training data
(from the run's ``recipe.yaml``), measured acceptance (eval/acceptance.py ``--out`` JSON) and
serving speedup (eval/serve_bench.py ``results.json``) with the commands that produced them,
and the ``vllm serve`` line.

Pushing uses ``huggingface_hub``: ``create_repo(repo_id, private=..., exist_ok=True)`` then
``upload_folder``. The token comes from ``HF_TOKEN`` or the standard login (``hf auth login``);
it is passed to the client only, never printed or written.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import yaml

from .results import AcceptanceResult, ServeResults, read_acceptance
from ..methods import DraftMethodSpec, UnknownMethodError, method_of_export

DRAFT_FILES = ("config.json", "model.safetensors", "generation_config.json")
# Hub dataset ids look like "owner/name"; local files and builtin: sets are not listed in the card.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_DATA_SUFFIXES = (".json", ".jsonl", ".parquet", ".csv", ".txt")


class HubError(RuntimeError):
    """Preparing or pushing the Hub folder failed; the message names the folder or repo."""


@dataclass(frozen=True)
class _MethodCard:
    """How the card names a draft method and which facts of its ``config.json`` it lists."""

    title: str
    summary: str
    facts: Callable[[dict[str, Any]], list[str]]
    num_speculative_tokens: Callable[[dict[str, Any]], int | None]


def _eagle3_facts(cfg: dict[str, Any]) -> list[str]:
    facts = _eagle3_export_facts(cfg)
    fmt = "speculators" if facts.format == "speculators" else "legacy LlamaForCausalLMEagle3"
    return [f"- method: EAGLE-3 (one Llama decoder layer over three target hidden states), format {fmt}",
            f"- aux hidden-state layer ids: {facts.aux_layer_ids} (vLLM convention: residual stream after L layers)",
            f"- draft vocab size: {facts.draft_vocab_size} of the target's {facts.vocab_size} tokens "
            "(d2t / t2d included)",
            f"- hidden size {facts.hidden_size}; norm_before_residual {facts.norm_before_residual}; "
            f"default num_speculative_tokens {_eagle3_k(cfg) or 3}"]


def _eagle3_k(cfg: dict[str, Any]) -> int | None:
    return _eagle3_export_facts(cfg).num_speculative_tokens


def _eagle3_export_facts(cfg: dict[str, Any]):
    """The EAGLE-3 keys of the export as their format's owner (and vLLM) reads them, either layout."""
    from ..models.eagle3.config import Eagle3Config

    return Eagle3Config.export_facts(cfg)


def _medusa_facts(cfg: dict[str, Any]) -> list[str]:
    return [f"- method: Medusa, {cfg.get('num_heads')} heads (head k predicts the token k+1 ahead from the "
            f"target's last hidden state), {cfg.get('num_hidden_layers')} residual block(s) per head",
            f"- hidden size {cfg.get('hidden_size')}; vocab size {cfg.get('vocab_size')} (the target's)"]


def _mlp_speculator_facts(cfg: dict[str, Any]) -> list[str]:
    return [f"- method: MLP speculator, {cfg.get('n_predict')} stages (each predicts one more token from the "
            "previous stage's state and token embedding)",
            f"- embedding size {cfg.get('emb_dim')}, inner size {cfg.get('inner_dim')}; vocab size "
            f"{cfg.get('vocab_size')} (the target's); tied stages {cfg.get('tie_weights')}"]


# Keyed by the registered method name (draftsmith.methods); a method without an entry gets a
# card with its name only.
_METHOD_CARDS = {
    "eagle3": _MethodCard("EAGLE-3", "EAGLE-3 (arXiv:2503.01840)", _eagle3_facts, _eagle3_k),
    "medusa": _MethodCard("Medusa", "Medusa heads (arXiv:2401.10774)", _medusa_facts, lambda c: c.get("num_heads")),
    "mlp_speculator": _MethodCard("MLP speculator", "an MLP speculator (arXiv:2404.19124)", _mlp_speculator_facts,
                                  lambda c: c.get("n_predict")),
}


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
    from ..data_prep.target import verifier_name

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
    data, train = recipe.get("data", {}), recipe.get("train", {})
    sources = ", ".join(f"`{s.get('path')}`" + (f" (first {s['max_rows']} rows)" if s.get("max_rows") else "")
                        for s in data.get("sources", []))
    regen = data.get("regenerate") or {}
    lines = [f"- data: {sources}"]
    if regen.get("enabled"):
        lines.append(f"- assistant replies regenerated by the target (self-distillation) at temperatures "
                     f"{regen.get('temperatures')}, up to {regen.get('max_new_tokens')} new tokens")
    lines += [f"- max sequence length {data.get('max_length')} tokens; TTT steps {train.get('ttt_steps')}, "
              f"gamma {train.get('gamma')}; lr {train.get('lr')}, batch {train.get('batch_size')} x "
              f"accumulation {train.get('grad_accum_steps')}; "
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
            cmd = (f"python -m draftsmith.eval.acceptance --target {target} --draft DRAFT_DIR --method {method} "
                   f"--prompts {r.prompts} --k {r.num_speculative_tokens} --temperature {r.temperature}")
    lines += ["", "Acceptance length = 1 + accepted / drafts (counts the bonus token); rate = accepted / proposed.", ""]
    if cmd:
        lines += ["Command (reconstructed from the result file):", "", "```bash", cmd, "```", ""]
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
               card_license: str | None = None) -> str:
    """The ``README.md`` of the Hub folder: YAML front matter (``base_model`` = the target,
    ``license``, ``datasets``, ``library_name``, ``tags``) and Markdown for the draft's method.

    Args:
        card_license: the card's ``license``; default: the target's when it is a local directory whose
            model card names one, else ``other``.

    Raises:
        HubError: no registered method recognises ``cfg``.
    """
    spec = _method(cfg)
    card = _METHOD_CARDS.get(spec.name) or _MethodCard(spec.name, f"a {spec.name} draft", lambda c: [], lambda c: None)
    target = _verifier(cfg, recipe) or "TARGET"
    k = card.num_speculative_tokens(cfg) or 3
    serve_spec = spec.speculative_config(repo_id, k)
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
               "(`python -m draftsmith.eval.spec_decode`) runs it with any version."]
    out = ["---", yaml.safe_dump(front, sort_keys=False).strip(), "---", "",
           f"# {card.title} draft for {target}", "",
           f"A speculative-decoding draft model, {card.summary}, for `{target}`, trained with draftsmith "
           f"and stored in the format vLLM loads for `method: {spec.vllm_method}`.", "",
           "## Use with vLLM", "", *use, "",
           "## Draft", "", *card.facts(cfg), f"- target (verifier): `{target}`", "",
           "## Training data", ""] + _training_section(recipe) + [""]
    measured = _acceptance_section(acceptance, target) + _serve_section(serve)
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
    """Copy the exported draft into ``out`` and write the model card; returns ``out``.

    Raises:
        HubError: ``draft`` is not an exported draft, or an attached file is unreadable or not
            the schema of :mod:`draftsmith.eval.results`.
    """
    cfg = _read(draft / "config.json", "draft config (run eval/export.py first)", lambda p: json.loads(p.read_text()))
    if not (draft / "model.safetensors").is_file():
        raise HubError(f"{draft / 'model.safetensors'} missing: not an exported draft")
    rec = None
    if recipe is not None:
        try:
            rec = yaml.safe_load(Path(recipe).read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise HubError(f"{recipe}: cannot read the recipe ({exc})") from exc
    card = model_card(cfg, repo_id, rec, _read(acceptance, "acceptance result", read_acceptance),
                      _read(serve, "serving results", ServeResults.read), card_license)
    out.mkdir(parents=True, exist_ok=True)
    for name in DRAFT_FILES:
        if (draft / name).is_file():
            shutil.copy2(draft / name, out / name)
    (out / "README.md").write_text(card)
    return out


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("draft", type=Path, help="exported draft directory (eval/export.py)")
    p.add_argument("--out", type=Path, required=True, help="Hub folder to write")
    p.add_argument("--repo-id", required=True, help="USER/NAME on the Hub (also written into the vllm serve line)")
    p.add_argument("--recipe", type=Path, help="the run's recipe.yaml (training data in the card)")
    p.add_argument("--acceptance", type=Path, help="eval/acceptance.py --out JSON")
    p.add_argument("--serve", type=Path, help="eval/serve_bench.py results.json")
    p.add_argument("--license", help="the card's license (default: the target's when its local model card "
                   "names one, else 'other')")
    p.add_argument("--push", action="store_true", help="create the repo and upload the folder")
    p.add_argument("--private", action="store_true", help="create the repo private")
    args = p.parse_args(argv)
    try:
        folder = prepare_folder(args.draft, args.out, args.repo_id, args.recipe, args.acceptance, args.serve,
                                args.license)
        print(f"Hub folder: {folder}")
        if args.push:
            print(f"pushed {args.repo_id}: {push(folder, args.repo_id, args.private)}")
    except HubError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
