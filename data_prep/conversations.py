"""Chat datasets: loading, normalising to OpenAI ``messages``, and tokenising with an
assistant-only loss mask.

Accepted row shapes (``format: auto`` detects them per row):

- ``messages``: ``{"messages": [{"role": "user"|"assistant"|"system"|"tool", "content": str}]}``
- ``sharegpt``: ``{"conversations": [{"from": "human"|"gpt"|"system"|..., "value": str}]}``
- ``alpaca``: ``{"instruction": str, "input": str?, "output": str}``
- ``prompt``: ``{"prompt": str}`` (a user turn whose response the target will generate)
- ``mt_bench``: ``{"turns": [str, ...]}`` (FastChat's ``question.jsonl``) or ``{"prompt": [str, ...]}``
  (``HuggingFaceH4/mt_bench_prompts``, what ``builtin:mt_bench`` loads): user turns, of which
  the first is kept as the prompt
- ``tokenized``: ``{"input_ids": [int], "loss_mask": [0|1]}`` (used as is)

A normalised record is ``{"id": str, "messages": [...]}`` or ``{"id", "input_ids", "loss_mask"}``.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

log = logging.getLogger(__name__)

BUILTIN_PREFIX = "builtin:"
BUILTIN_DIR = Path(__file__).parent / "prompts"
# builtin sets that are not shipped but fetched from the Hub with ``datasets``
BUILTIN_HUB = {"mt_bench": "HuggingFaceH4/mt_bench_prompts"}

SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "system": "system",
    "tool": "tool",
    "function": "tool",
}
ROLES = {"system", "user", "assistant", "tool", "developer"}


class DataError(ValueError):
    """Bad input data; the message names the file and row."""


@dataclass
class LoadReport:
    """What a load kept and skipped: ``skipped`` maps a reason to its count, ``first_bad``
    holds the first offending ``(row number, message)``."""

    source: str
    rows: int = 0
    kept: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    first_bad: tuple[int, str] | None = None

    def skip(self, row: int, reason: str, message: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        if self.first_bad is None:
            self.first_bad = (row, message)

    def summary(self) -> str:
        s = f"{self.source}: {self.kept}/{self.rows} rows kept"
        if self.skipped:
            s += f"; skipped {dict(sorted(self.skipped.items()))}, first at row {self.first_bad[0]}: {self.first_bad[1]}"
        return s


def resolve_source_path(path: str) -> str:
    """``builtin:train`` / ``builtin:eval`` -> the project prompt set files;
    ``builtin:mt_bench`` -> the Hub dataset ``HuggingFaceH4/mt_bench_prompts``."""
    if path.startswith(BUILTIN_PREFIX):
        name = path[len(BUILTIN_PREFIX) :]
        if name in BUILTIN_HUB:
            return BUILTIN_HUB[name]
        f = BUILTIN_DIR / f"{name}.jsonl"
        if not f.is_file():
            raise FileNotFoundError(f"no builtin prompt set '{name}' (looked for {f})")
        return str(f)
    return path


def iter_rows(path: str, split: str = "train") -> Iterable[tuple[int, Any]]:
    """Yield ``(row number, row)``. Local JSONL is read line by line so a malformed line is
    reported by number (and yields a :class:`DataError` instance in place of the row); other
    local files and hub ids go through ``datasets.load_dataset``."""
    local = Path(path)
    if local.is_file() and local.suffix == ".jsonl":
        with local.open("rb") as fh:  # decoded line by line: a line that is not UTF-8 is one bad row
            for i, raw in enumerate(fh, start=1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    yield i, DataError(f"{path}:{i}: not UTF-8 (byte 0x{raw[exc.start]:02x} at column {exc.start + 1}); "
                                       "save the file as UTF-8")
                    continue
                if not line.strip():
                    continue
                try:
                    yield i, json.loads(line)
                except json.JSONDecodeError as exc:
                    # json's own text may end in " at" ("Invalid control character at"): one "at" here
                    problem = exc.msg.removesuffix(" at")
                    yield i, DataError(f"{path}:{i}: malformed JSON ({problem} at column {exc.colno})")
        return
    import datasets

    if local.exists():
        suffix = local.suffix.lstrip(".") if local.is_file() else "json"
        builder = {"jsonl": "json", "json": "json", "parquet": "parquet", "csv": "csv"}.get(suffix, suffix)
        ds = datasets.load_dataset(builder, data_files=str(local), split="train")
    elif path in BUILTIN_HUB.values():
        try:
            ds = datasets.load_dataset(path, split="train")
        except Exception as exc:  # offline, no Hub access, or the dataset moved
            raise DataError(
                f"could not load the Hub dataset {path} ({type(exc).__name__}: {exc}); pass a local copy "
                "with --prompts path/to/mt_bench.jsonl (FastChat's question.jsonl, rows with 'turns')"
            ) from exc
    else:
        ds = _load_hub_dataset(path, split)
    for i, row in enumerate(ds, start=1):
        yield i, row


DATA_SUFFIXES = (".json", ".jsonl", ".parquet", ".csv", ".txt", ".arrow")


def _load_hub_dataset(path: str, split: str) -> Any:
    """``datasets.load_dataset(path, split=split)`` of a source that is not a local file.

    Raises:
        DataError: one line naming the source: a file name that does not exist (a path, not a
            Hub dataset id), or a Hub dataset this machine cannot load (offline, gated, private,
            missing, no such split), with what to do.
    """
    import datasets
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(path)
        looks_like_a_file = path.lower().endswith(DATA_SUFFIXES)
    except HFValidationError:
        looks_like_a_file = True
    if looks_like_a_file:
        raise DataError(f"{path}: no such file; fix the source path (a local JSON/JSONL/Parquet/CSV file, or a Hub "
                        "dataset id ORG/NAME)")
    try:
        return datasets.load_dataset(path, split=split)
    except Exception as exc:  # offline, gated, private, missing, no such split: all end here
        reason = (str(exc).strip().splitlines() or [""])[0].split(". ")[0].rstrip(".")
        raise DataError(f"{path}: cannot load the Hub dataset (split {split!r}; {type(exc).__name__}: {reason}); "
                        f"check the id and split, or download it where the Hub is reachable (`hf download {path} "
                        "--repo-type dataset --local-dir DIR`, after `hf auth login` for a gated one) and name its "
                        "data file as the source path") from None


def normalise_row(row: Any, fmt: str, where: str) -> dict[str, Any]:
    """Turn one raw row into a record. ``where`` (file:row) prefixes every error.

    Raises:
        DataError: unknown shape, bad roles/order, empty turns, mismatched token lists.
    """
    if isinstance(row, DataError):
        raise row
    if not isinstance(row, dict):
        raise DataError(f"{where}: row is {type(row).__name__}, expected a JSON object")
    if fmt == "auto":
        fmt = detect_format(row, where)
    rid = str(row.get("id", row.get("question_id", row.get("prompt_id", where))))
    if fmt == "tokenized":
        ids, mask = row.get("input_ids"), row.get("loss_mask")
        if not isinstance(ids, list) or not isinstance(mask, list) or len(ids) != len(mask):
            raise DataError(f"{where}: 'input_ids' and 'loss_mask' must be lists of equal length")
        if not ids:
            raise DataError(f"{where}: empty 'input_ids'")
        return {"id": rid, "input_ids": [int(t) for t in ids], "loss_mask": [int(bool(m)) for m in mask]}
    if fmt == "messages":
        msgs = row.get("messages")
        if not isinstance(msgs, list):
            raise DataError(f"{where}: 'messages' must be a list")
        messages = []
        for j, m in enumerate(msgs):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise DataError(f"{where}: messages[{j}] needs 'role' and 'content'")
            msg = {"role": str(m["role"]), "content": m["content"]}
            if m.get("thinking"):  # harmony (gpt-oss) reasoning, rendered on the analysis channel
                msg["thinking"] = m["thinking"]
            reasoning = m.get("reasoning_content") or m.get("reasoning")  # <think> templates (vLLM's field names)
            if reasoning:
                msg["reasoning_content"] = reasoning
            messages.append(msg)
        if row.get("cut"):  # the last reply was cut by max_tokens (served traffic): no end-of-turn label
            validate_messages(messages, where)
            return {"id": rid, "messages": messages, "cut": True}
    elif fmt == "sharegpt":
        conv = row.get("conversations")
        if not isinstance(conv, list):
            raise DataError(f"{where}: 'conversations' must be a list")
        messages = []
        for j, m in enumerate(conv):
            if not isinstance(m, dict) or "from" not in m or "value" not in m:
                raise DataError(f"{where}: conversations[{j}] needs 'from' and 'value'")
            role = SHAREGPT_ROLES.get(str(m["from"]).lower())
            if role is None:
                raise DataError(f"{where}: conversations[{j}] has unknown speaker '{m['from']}'")
            messages.append({"role": role, "content": m["value"]})
    elif fmt == "alpaca":
        instruction = (row.get("instruction") or "").strip()
        extra = (row.get("input") or "").strip()
        user = f"{instruction}\n\n{extra}" if extra else instruction
        messages = [{"role": "user", "content": user}]
        if row.get("output") is not None:
            messages.append({"role": "assistant", "content": row["output"]})
    elif fmt in ("prompt", "mt_bench"):
        turns = row.get("prompt") if fmt == "prompt" else row.get("turns", row.get("prompt"))
        if isinstance(turns, list):  # MT-bench user turns (FastChat ``turns``, HuggingFaceH4 ``prompt``)
            messages = [{"role": "user", "content": turns[0] if turns else None}]
        else:
            messages = [{"role": "user", "content": turns}]
    else:
        raise DataError(f"{where}: unknown format '{fmt}'")
    validate_messages(messages, where)
    return {"id": rid, "messages": messages}


def detect_format(row: dict, where: str) -> str:
    if "input_ids" in row:
        return "tokenized"
    if "messages" in row:
        return "messages"
    if "conversations" in row:
        return "sharegpt"
    if "instruction" in row:
        return "alpaca"
    if "prompt" in row:
        return "prompt"
    if "turns" in row:
        return "mt_bench"
    raise DataError(
        f"{where}: cannot tell the row format from keys {sorted(row)[:8]} "
        "(expected messages, conversations, instruction/output, prompt, turns or input_ids)"
    )


def validate_messages(messages: list[dict], where: str) -> None:
    """Roles known, contents non-empty strings, the first non-system turn from the user, and
    user/assistant alternating (tool turns may follow an assistant turn).

    Raises:
        DataError: naming the turn index.
    """
    if not messages:
        raise DataError(f"{where}: conversation has no turns")
    prev = None
    for j, m in enumerate(messages):
        role, content = m["role"], m["content"]
        if role not in ROLES:
            raise DataError(f"{where}: turn {j} has unknown role '{role}'")
        if not isinstance(content, str) or not content.strip():
            raise DataError(f"{where}: turn {j} ({role}) is empty")
        if role in ("system", "developer"):
            if prev not in (None, "system", "developer"):
                raise DataError(f"{where}: turn {j} is a {role} turn after the conversation started")
        elif role == "user":
            if prev == "user":
                raise DataError(f"{where}: turn {j}: two user turns in a row (roles out of order)")
        elif role == "assistant":
            if prev not in ("user", "tool"):
                raise DataError(f"{where}: turn {j}: assistant turn without a preceding user turn")
        prev = role


def has_assistant_turn(record: dict) -> bool:
    if "input_ids" in record:
        return any(record["loss_mask"])
    return any(m["role"] == "assistant" for m in record["messages"])


def iter_records(
    path: str, fmt: str = "auto", split: str = "train", max_rows: int | None = None, strict: bool = False,
    report: LoadReport | None = None,
) -> Iterator[dict]:
    """Normalised records of one dataset, read lazily (one row in memory at a time). Bad rows
    are skipped and counted in ``report`` (``strict``: raised); a repeated id gets ``#row``
    appended. Stops after ``max_rows`` kept rows.

    Raises:
        DataError: in strict mode, at the first bad row; when the source is exhausted and no
            row survived.
    """
    path = resolve_source_path(path)
    report = report if report is not None else LoadReport(source=path)
    report.source = path
    seen_ids: set = set()
    if max_rows is not None and max_rows <= 0:
        return
    for i, row in iter_rows(path, split):
        report.rows += 1
        where = f"{path}:{i}"
        try:
            rec = normalise_row(row, fmt, where)
        except DataError as exc:
            if strict:
                raise
            report.skip(i, "malformed" if isinstance(row, DataError) else "invalid", str(exc))
            continue
        if rec["id"] in seen_ids:
            rec["id"] = f"{rec['id']}#{i}"
        seen_ids.add(rec["id"])
        report.kept += 1
        yield rec
        if max_rows is not None and report.kept >= max_rows:
            return
    if not report.kept:
        raise DataError(f"{path}: no usable rows ({report.summary()})")


def load_records(
    path: str, fmt: str = "auto", split: str = "train", max_rows: int | None = None, strict: bool = False
) -> tuple[list[dict], LoadReport]:
    """:func:`iter_records` as a list, with its report (for prompt sets and tests; the data
    stages stream).

    Raises:
        DataError: in strict mode, at the first bad row; always when no row survives.
    """
    report = LoadReport(source=path)
    records = list(iter_records(path, fmt, split, max_rows, strict, report))
    return records, report


def assistant_char_spans(tokenizer: Any, messages: list[dict], cut: bool = False,
                         template_kwargs: dict | None = None) -> tuple[str, list[tuple[int, int]]]:
    """The sequence to train on and the characters of ``messages`` that are labels: each
    assistant reply as the target emits it when served (:mod:`~draftsmith.data_prep.served_turns`).

    Reply i is rendered as the last turn of ``messages[:i+1]`` after the generation prompt
    ``render(messages[:i], add_generation_prompt=True, **template_kwargs)``; its span covers the
    reply (with its reasoning when the template thinks) and the end-of-turn marker, never the
    generation prompt (R1's forced ``<think>\\n``, Qwen3's empty think block when thinking is off).
    The text is the last reply's served sequence (the whole rendering when it extends it), so the
    last reply is always labelled. An earlier reply is labelled where its served sequence is a
    prefix of that text (every reply for templates that render history as they served it); a
    template that rewrites history (Qwen3 drops past reasoning and think blocks, Kimi-K2-Thinking
    empties them) shows earlier replies differently from how the target wrote them, so those
    stay unlabelled context: the row trains what the target emits when serving the last turn,
    given the history as the template renders it (``data.history_turns: each`` trains each of
    them in a row of its own, :func:`turn_char_spans`). ``cut``: the last reply was cut by
    ``max_tokens``; its span ends with its own text, without the end-of-turn marker (and, cut
    inside its reasoning, without ``</think>`` or an answer); the text ends there too when the
    template's rendering of the whole conversation does not continue it. Earlier replies cut by
    ``max_tokens`` are history, rendered as the template renders it.

    With a thinking template (``</think>`` in it) reasoning is read from ``reasoning_content``
    or a ``<think>...</think>`` head of the content (:func:`~draftsmith.data_prep.served_turns.with_reasoning`;
    a cut last reply's raw text is read by :func:`~draftsmith.data_prep.served_turns.served_turn`,
    where ``<think>`` without ``</think>`` is reasoning, not answer).

    Raises:
        DataError: the template gives no assistant mask (a reply it renders apart from its own
            generation prompt), or a reply's reasoning has no place in it (thinking off).
    """
    rows, _ = turn_char_spans(tokenizer, messages, cut, template_kwargs, each=False)
    return rows[-1][1], rows[-1][2]


def turn_char_spans(tokenizer: Any, messages: list[dict], cut: bool = False, template_kwargs: dict | None = None,
                    each: bool = True) -> tuple[list[tuple[int | None, str, list[tuple[int, int]]]], list[int]]:
    """The rows of one conversation as ``(turn, text, spans)`` and the replies its full row leaves
    unlabelled (their ordinals among the assistant replies, the last excepted).

    The full row, :func:`assistant_char_spans`' text and spans, comes last with ``turn`` None.
    ``each`` (``data.history_turns: each``): before it, one row per reply the full row leaves
    unlabelled because the template rewrites it as history (Qwen3 and Kimi-K2-Thinking with
    thinking, DeepSeek-R1 / V3.1): ``turn`` k is the conversation up to and including reply k,
    rendered with that reply as the last turn and labelled the same way, so reply k is labelled
    as served (and any earlier reply whose served sequence is a prefix of that row's text).
    A template that renders history as served leaves no reply unlabelled: one row either way.
    Only the full row ends with the last reply, so ``cut`` applies to it alone.

    Raises:
        DataError: as :func:`assistant_char_spans`.
    """
    from . import served_turns as st

    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if st.is_thinking_template(tokenizer):  # a cut last reply is split by served_turn, which knows it was cut
        messages = [m if cut and turns and k == turns[-1] else st.with_reasoning(m) for k, m in enumerate(messages)]
    if not turns:
        return [(None, st.render(tokenizer, messages, template_kwargs), [])], []
    try:
        served = [st.served_turn(tokenizer, messages, i, template_kwargs, cut=cut and i == turns[-1]) for i in turns]
    except st.TemplateError as exc:
        raise DataError(str(exc)) from None
    text, spans = _row_spans(tokenizer, messages, served, template_kwargs)
    unlabelled = [k for k, t in enumerate(served[:-1]) if t.reply and not text.startswith(t.text)]
    rows = [(k, *_row_spans(tokenizer, messages[: served[k].index + 1], served[: k + 1], template_kwargs))
            for k in (unlabelled if each else [])]
    return [*rows, (None, text, spans)], unlabelled


def _row_spans(tokenizer: Any, messages: list[dict], served: list, template_kwargs: dict | None,
               ) -> tuple[str, list[tuple[int, int]]]:
    """The text of the row that ends with ``served[-1]`` (the whole rendering of ``messages`` when
    it extends that reply's served sequence) and the spans of the replies served as a prefix of it."""
    from .served_turns import render

    full = render(tokenizer, messages, template_kwargs)
    text = full if full.startswith(served[-1].text) else served[-1].text
    return text, [(len(t.prompt), len(t.text)) for t in served if t.reply and text.startswith(t.text)]


_HARMONY_MESSAGE = re.compile(
    r"<\|start\|>(?P<role>[^<]*?)(?:<\|channel\|>(?P<channel>[^<]*?))?(?:<\|constrain\|>[^<]*)?"
    r"<\|message\|>(?P<body>.*?)(?P<end><\|end\|>|<\|return\|>|<\|call\|>)",
    re.DOTALL,
)


def is_harmony_template(tokenizer: Any) -> bool:
    """gpt-oss's harmony format (``<|start|>role<|channel|>name<|message|>...<|end|>``)."""
    return "<|channel|>" in (getattr(tokenizer, "chat_template", None) or "")


def harmony_assistant_spans(text: str, channels: tuple[str, ...] = ("analysis", "final"),
                            cut: bool = False) -> list[tuple[int, int]]:
    """Character spans of assistant message bodies (plus their end marker) whose channel is in
    ``channels``. Harmony renders earlier turns differently from the last (the template drops
    past reasoning), so spans are read off the one full rendering rather than from prefixes.
    System, developer, user and tool messages are never selected; a message without a
    channel counts as ``final``. ``cut``: the last span stops before its end marker (a reply
    cut by ``max_tokens``)."""
    spans, last_marker = [], None
    for m in _HARMONY_MESSAGE.finditer(text):
        role = m.group("role").strip().split(" ")[0]
        channel = (m.group("channel") or "final").strip().split(" ")[0]
        if role == "assistant" and channel in channels:
            spans.append((m.start("body"), m.end("end")))
            last_marker = m.start("end")
    if cut and spans:
        spans[-1] = (spans[-1][0], last_marker)
    return spans


def tokenize_conversation(tokenizer: Any, messages: list[dict], max_length: int | None = None,
                          harmony_channels: tuple[str, ...] | None = None,
                          reasoning_effort: str | None = None, cut: bool = False,
                          template_kwargs: dict | None = None, where: str | None = None) -> dict:
    """Tokenise with the chat template; ``loss_mask[i] = 1`` iff token i overlaps an assistant span.

    ``harmony_channels`` (gpt-oss): select assistant messages by channel (``analysis``,
    ``final``) with :func:`harmony_assistant_spans` instead of the prefix method;
    ``reasoning_effort`` is passed to the template (the effort the reply was regenerated at).
    ``cut``: the last assistant reply was cut by ``max_tokens``; the end-of-turn marker after it
    gets no label (see :func:`assistant_char_spans`; with harmony, the marker is left out of the
    last span). ``template_kwargs``: ``data.chat_template_kwargs``, the kwargs the target is served
    with (``{"enable_thinking": False}``), passed to every rendering. ``where`` (``row <id>``)
    prefixes the errors.

    Returns:
        ``{"input_ids": list[int], "loss_mask": list[int], "truncated": bool}``.

    Raises:
        DataError: template problems (see :func:`assistant_char_spans`) or a slow tokenizer
            without offset mapping.
    """
    kwargs = dict(template_kwargs or {})
    if harmony_channels is not None:
        if reasoning_effort:
            kwargs["reasoning_effort"] = reasoning_effort
        text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
        return _tokenize_spans(tokenizer, text, harmony_assistant_spans(text, harmony_channels, cut=cut), max_length)
    return tokenize_turns(tokenizer, messages, max_length, cut, kwargs or None, where, each=False)[0][-1][1]


def tokenize_turns(tokenizer: Any, messages: list[dict], max_length: int | None = None, cut: bool = False,
                   template_kwargs: dict | None = None, where: str | None = None,
                   each: bool = True) -> tuple[list[tuple[int | None, dict]], list[int]]:
    """:func:`turn_char_spans` tokenised: ``([(turn, tokenised row)], unlabelled replies)``, the
    full row last (``turn`` None), each row as :func:`tokenize_conversation` returns it. Not for
    harmony templates (their spans come from :func:`harmony_assistant_spans`).

    Raises:
        DataError: as :func:`tokenize_conversation`.
    """
    try:
        rows, unlabelled = turn_char_spans(tokenizer, messages, cut, template_kwargs, each)
    except DataError as exc:
        raise DataError(f"{where}: {exc}" if where else str(exc)) from None
    return [(turn, _tokenize_spans(tokenizer, text, spans, max_length)) for turn, text, spans in rows], unlabelled


def _tokenize_spans(tokenizer: Any, text: str, spans: list[tuple[int, int]], max_length: int | None) -> dict:
    """``text`` tokenised, ``loss_mask[i] = 1`` iff token i overlaps a span, cut to ``max_length``."""
    if not getattr(tokenizer, "is_fast", False):
        raise DataError("assistant masks need a fast tokenizer (offset mapping); got a slow one")
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    mask = [0] * len(ids)
    s = 0
    for i, (a, b) in enumerate(offsets):
        while s < len(spans) and spans[s][1] <= a:
            s += 1
        if s < len(spans) and a < spans[s][1] and b > spans[s][0]:
            mask[i] = 1
    truncated = max_length is not None and len(ids) > max_length
    if truncated:
        ids, mask = ids[:max_length], mask[:max_length]
    return {"input_ids": ids, "loss_mask": mask, "truncated": truncated}
