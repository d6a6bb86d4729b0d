"""Served traffic as training data: read the proxy's log of served completions.

A vLLM deployment behind ``draftsmith proxy`` (:mod:`draftsmith.serve.proxy`) appends one JSON
line per finished ``/v1/chat/completions`` or ``/v1/completions`` request to ``traffic.jsonl``
(rotated to ``traffic.jsonl.1``, ``.2``, ...), in the schema of :mod:`draftsmith.traffic_log`.

Every served completion is the target's own output on the real prompt distribution: data for
self-distillation that needs no regeneration. :func:`read_traffic` turns the log into
conversations (``{"id", "messages"}``: the request's messages, then the served reply as the
assistant turn) and skips, with a count per reason and the first offending ``file:line``:

- ``unparseable line``: not JSON or not an object (a line cut by a crash or a full disk);
- ``schema version``: a line of another log version;
- ``failed request``: an HTTP status other than 200, or no choices;
- ``other model``: a request naming another model than the deployment's;
- ``raw completions endpoint``: ``/v1/completions`` prompts are raw text, not chat turns the
  target's chat template renders, so they are not training conversations for a chat draft;
- ``no user turn`` / ``non-text content``: messages that cannot be rendered as a text chat;
- ``incomplete reply``: no ``finish_reason`` (the client left mid-stream or the stream broke:
  the text is a prefix of what the target would have written);
- ``empty completion``;
- ``duplicate``: the same prompt (the request's messages) served again; the first is kept,
  so a prompt is never both trained on and held out.

A reply cut by ``max_tokens`` (``finish_reason == "length"``) is kept: every token of it is the
target's own output. It is marked ``"cut": true`` and counted apart (``TrafficReport.cut``); the
tokenizer then gives the template's end-of-turn marker after it no label (nor, for a reply cut
inside its reasoning, a ``</think>`` it never wrote;
:func:`draftsmith.data_prep.conversations.tokenize_conversation`), so the draft is not taught to
end a reply where the target would have gone on. Regenerated rows carry the same mark
(:mod:`draftsmith.data_prep.regenerate`). ``keep_cut=False`` skips them instead
(``cut by max_tokens``).

:func:`holdout_split` then holds out a seeded, hash-chosen share of prompts for evaluation.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..traffic_log import LOG_VERSION


class TrafficError(ValueError):
    """A traffic log that cannot be used: missing files, or nothing usable (the message holds the counts)."""


def traffic_log_files(path: str | Path) -> list[Path]:
    """The log ``path`` and its rotated files (``path.1`` ... ``path.N``), oldest first.

    Raises:
        TrafficError: neither ``path`` nor any rotated file exists.
    """
    path = Path(path).expanduser()
    rotated = []
    for p in path.parent.glob(path.name + ".*"):
        m = re.fullmatch(re.escape(path.name) + r"\.(\d+)", p.name)
        if m and p.is_file():
            rotated.append((int(m.group(1)), p))
    files = [p for _, p in sorted(rotated, reverse=True)] + ([path] if path.is_file() else [])
    if not files:
        raise TrafficError(f"{path}: no traffic log there (nor rotated {path.name}.N files)")
    return files


@dataclass
class TrafficReport:
    """What :func:`read_traffic` kept and skipped: ``skipped`` maps a reason to its count,
    ``first_bad`` a reason to its first ``file:line``; ``models`` counts served requests per
    model name; ``temperatures`` counts kept replies per sampling temperature; ``cut`` counts the
    kept replies that ``max_tokens`` cut (part of ``kept``)."""

    files: list[str] = field(default_factory=list)
    lines: int = 0
    kept: int = 0
    cut: int = 0
    model: str | None = None
    skipped: dict[str, int] = field(default_factory=dict)
    first_bad: dict[str, str] = field(default_factory=dict)
    models: dict[str, int] = field(default_factory=dict)
    temperatures: dict[str, int] = field(default_factory=dict)

    def skip(self, reason: str, where: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        self.first_bad.setdefault(reason, where)

    def summary(self) -> str:
        """One line: lines read, kept, and each skip reason with its count and first place."""
        parts = [f"{n} {reason} (first at {self.first_bad[reason]})" for reason, n in sorted(self.skipped.items())]
        return (f"{self.lines} lines in {len(self.files)} file(s), {self.kept} conversations kept"
                + (f" ({self.cut} cut by max_tokens, trained without an end-of-turn label)" if self.cut else "")
                + (f"; skipped: {', '.join(parts)}" if parts else ""))

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _text(content: Any) -> str | None:
    """A message's text: a string, or the text parts of an OpenAI content list (None: other parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    return None


def _prompt_messages(request: dict[str, Any]) -> tuple[list[dict[str, str]] | None, str | None]:
    """``(messages, None)`` of a chat request, or ``(None, skip reason)``."""
    messages = request.get("messages")
    if not isinstance(messages, list) or not messages:
        return None, "no user turn"
    out = []
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant"):
            return None, "non-text content"
        text = _text(m.get("content"))
        if text is None:
            return None, "non-text content"
        out.append({"role": m["role"], "content": text})
    if out[-1]["role"] != "user":
        return None, "no user turn"
    return out, None


def prompt_key(messages: list[dict[str, str]]) -> str:
    """sha256 of a prompt's messages (role and text), the identity for dedup and hold-out."""
    canon = json.dumps([[m["role"], m["content"]] for m in messages], ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canon.encode()).hexdigest()


def _served_lines(files: list[Path], report: TrafficReport):
    """``(where, record)`` of every parseable line of the current schema version."""
    for f in files:
        with f.open(encoding="utf-8", errors="replace") as fh:
            for n, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                report.lines += 1
                where = f"{f}:{n}"
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    report.skip("unparseable line", where)
                    continue
                if not isinstance(rec, dict):
                    report.skip("unparseable line", where)
                    continue
                if rec.get("version") != LOG_VERSION:
                    report.skip("schema version", where)
                    continue
                yield where, rec


def _majority_model(files: list[Path]) -> str | None:
    counts: Counter[str] = Counter()
    for _, rec in _served_lines(files, TrafficReport()):
        if rec.get("status") == 200 and isinstance(rec.get("model"), str):
            counts[rec["model"]] += 1
    return counts.most_common(1)[0][0] if counts else None


def read_traffic(path: str | Path, model: str | None = None, keep_cut: bool = True
                 ) -> tuple[list[dict[str, Any]], TrafficReport]:
    """Conversations of the served chat completions in the log at ``path`` (and its rotations).

    Args:
        path: ``traffic.jsonl`` as the proxy writes it.
        model: the deployment's model name (requests naming another are skipped); None: the
            model most served requests name.
        keep_cut: keep replies cut by ``max_tokens`` (marked ``"cut": true``); False: skip them.

    Returns:
        ``(conversations, report)``: each conversation ``{"id": "traffic-<request id>[-<choice>]",
        "messages": [...prompt..., {"role": "assistant", "content": served reply}],
        "prompt_key": sha256, "temperature": float | None, "cut": bool}``, in log order; see
        the module docstring for what is skipped.

    Raises:
        TrafficError: no log file at ``path``.
    """
    files = traffic_log_files(path)
    report = TrafficReport(files=[str(f) for f in files])
    report.model = model if model is not None else _majority_model(files)
    seen: set[str] = set()
    out: list[dict[str, Any]] = []
    for where, rec in _served_lines(files, report):
        if isinstance(rec.get("model"), str):
            report.models[rec["model"]] = report.models.get(rec["model"], 0) + 1
        choices = rec.get("choices") or []
        if rec.get("status") != 200 or not isinstance(choices, list) or not choices:
            report.skip("failed request", where)
            continue
        if report.model is not None and rec.get("model") != report.model:
            report.skip("other model", where)
            continue
        if rec.get("endpoint") != "chat":
            report.skip("raw completions endpoint", where)
            continue
        request = rec.get("request")
        prompt, reason = _prompt_messages(request) if isinstance(request, dict) else (None, "no user turn")
        if prompt is None:
            report.skip(reason or "no user turn", where)
            continue
        key = prompt_key(prompt)
        if key in seen:
            report.skip("duplicate", where)
            continue
        kept_one = False
        for i, choice in enumerate(choices):
            text = choice.get("text") if isinstance(choice, dict) else None
            finish = choice.get("finish_reason") if isinstance(choice, dict) else None
            if finish == "length" and not keep_cut:
                report.skip("cut by max_tokens", where)
                continue
            if finish is None:  # the client left mid-stream, or the stream broke: a partial reply
                report.skip("incomplete reply", where)
                continue
            if not isinstance(text, str) or not text.strip():
                report.skip("empty completion", where)
                continue
            temperature = request.get("temperature")
            suffix = f"-{i}" if len(choices) > 1 else ""
            out.append({"id": f"traffic-{rec.get('id', report.lines)}{suffix}",
                        "messages": prompt + [{"role": "assistant", "content": text}],
                        "prompt_key": key, "temperature": temperature, "cut": finish == "length"})
            report.cut += finish == "length"
            t = "default" if temperature is None else f"{float(temperature):g}"
            report.temperatures[t] = report.temperatures.get(t, 0) + 1
            kept_one = True
        if kept_one:
            seen.add(key)
    report.kept = len(out)
    return out, report


def holdout_split(conversations: list[dict[str, Any]], fraction: float, seed: int = 0
                  ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(train, held_out)``: a prompt is held out when the seeded sha256 of its ``prompt_key``
    falls below ``fraction`` (stable as the log grows: a prompt never moves between sides).

    Raises:
        ValueError: ``fraction`` outside [0, 1).
    """
    if not 0 <= fraction < 1:
        raise ValueError(f"hold-out fraction {fraction} must be in [0, 1)")
    train, held = [], []
    for c in conversations:
        h = int(hashlib.sha256(f"{seed}:{c['prompt_key']}".encode()).hexdigest()[:12], 16) / 16 ** 12
        (held if h < fraction else train).append(c)
    return train, held
