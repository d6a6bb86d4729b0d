"""One line per recipe problem: what :func:`draftsmith.recipe.load_recipe` says of a YAML parse
error and of each pydantic error, naming the key (a moved key or another method's says where it
belongs)."""

from __future__ import annotations

import typing
from typing import Any

import yaml

from .draft_section import ACCEPT_WEIGHTING_METHODS, opd_unsupported

# draft keys some methods take and the others do not have: their one line for a method without the
# key (a method that inherits the key and refuses it says the same from its section)
UNSUPPORTED = {
    "draft.accept_weighting": lambda method: (
        f"draft.accept_weighting: not supported by draft.method {method} (supported: "
        f"{', '.join(ACCEPT_WEIGHTING_METHODS)}; docs/training.md, \"Acceptance-aware loss\")"),
    "draft.opd": opd_unsupported,
}


def yaml_problem(exc: yaml.YAMLError) -> str:
    """One line for a YAML parse error: the problem and its line / column (1-based)."""
    problem = getattr(exc, "problem", None) or getattr(exc, "context", None) or str(exc).splitlines()[0]
    mark = getattr(exc, "problem_mark", None)
    return f"{problem}, line {mark.line + 1} column {mark.column + 1}" if mark is not None else problem


# keys of earlier recipes -> where they are now; a recipe that still sets one is refused naming it
MOVED_KEYS = {
    **{f"train.{key}": f"draft.{key}" for key in ("ttt_steps", "gamma", "head_decay", "loss", "lk_kl_scale",
                                                  "lk_kl_decay", "gradient_checkpointing")},
    "eval.vllm": "vllm",
    "train.wandb": "train.report_to: [wandb], train.tracker_project and train.wandb_mode",
}


def _draft_owners(key: str) -> list[str]:
    """The ``draft.method`` values whose section has ``key``."""
    from .recipe import DraftConfig

    sections = typing.get_args(typing.get_args(DraftConfig)[0])
    return [cls.model_fields["method"].default for cls in sections if key in cls.model_fields]


def recipe_problem(err: dict[str, Any]) -> tuple[str, str]:
    """``(key.path, "key.path: message")`` of one pydantic error; an unknown key that is one of
    another place's (a moved key, another method's) says where it belongs."""
    loc = [str(p) for p in err["loc"]]
    method = None
    if len(loc) >= 2 and loc[0] == "draft" and loc[1] in _draft_owners("method"):
        method = loc.pop(1)  # the union's tag: draft.<method>.key is the recipe's draft.key
    key = ".".join(loc)
    if err["type"] == "union_tag_invalid" and loc == ["draft"]:  # a method plug-in that did not load says why
        from .methods import plugin_load_failure

        tag = (err.get("ctx") or {}).get("tag")
        failure = plugin_load_failure(tag) if isinstance(tag, str) else None
        if failure:
            return "draft.method", f"draft.method: {tag!r} is not available: {failure}"
    if err["type"] != "extra_forbidden":
        return key, f"{key}: {err['msg']}" if key else err["msg"]
    if key in MOVED_KEYS:
        new = MOVED_KEYS[key]
        owners = _draft_owners(new.removeprefix("draft.")) if new.startswith("draft.") else []
        return key, (f"{key}: unknown key: it moved to {new}"
                     + (f" (draft.method {' / '.join(owners)})" if owners else ""))
    owners = _draft_owners(loc[1]) if len(loc) == 2 and loc[0] == "draft" else []
    if method is not None and key in UNSUPPORTED:  # one line whichever method lacks the key
        return key, UNSUPPORTED[key](method)
    if method is not None and owners:
        return key, f"{key}: unknown key for draft.method {method} (a key of {' / '.join(owners)})"
    return key, f"{key}: unknown key"
