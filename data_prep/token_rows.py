"""The tokenize stage's rows: one conversation -> its tokenised row, and under
``data.history_turns: each`` one more row per earlier reply its chat template rewrites as history
(:func:`~draftsmith.data_prep.conversations.turn_char_spans`), and the counts ``stats.json`` keeps
of those."""

from __future__ import annotations

import json
import logging
from typing import Any

import numpy as np

from . import conversations as conv

log = logging.getLogger("draftsmith.prepare")


class TokenizeRow:
    """The tokenize stage's row function (``datasets.map`` with ``batched=True``; picklable for
    ``num_proc``): each ``{"record": JSON}`` row -> one or more rows of the tokenised columns plus
    ``status`` (``ok`` or the skip reason), ``error``, ``truncated`` (counted as truncated),
    ``assistant_tokens``, ``turn`` (-1: the conversation's full row; k: the extra row of reply k,
    id ``<id>#turn<k>``, ``data.history_turns: each``) and ``unlabelled`` (on the full row: the
    earlier replies it leaves unlabelled because the template rewrites them as history)."""

    def __init__(self, tok, max_len: int, channels, vocab_size: int, overlong: str, template_kwargs: dict | None = None,
                 history_turns: str = "last"):
        self.tok, self.max_len, self.channels, self.vocab_size, self.overlong = tok, max_len, channels, vocab_size, overlong
        self.template_kwargs = dict(template_kwargs or {})  # data.chat_template_kwargs: rendered as served
        self.each = history_turns == "each"

    def __call__(self, batch: dict) -> dict:
        rows = [row for record in batch["record"] for row in self.rows(json.loads(record))]
        return {k: [row[k] for row in rows] for k in rows[0]} if rows else {}

    def rows(self, r: dict) -> list[dict]:
        out = {"id": str(r["id"]), "input_ids": [], "loss_mask": [], "length": 0, "status": "ok", "error": None,
               "truncated": False, "assistant_tokens": 0, "turn": -1, "unlabelled": 0}
        try:
            if "input_ids" in r:
                ids, mask = r["input_ids"], r["loss_mask"]
                bad = [t for t in ids if not 0 <= t < self.vocab_size]
                if bad:
                    raise conv.DataError(
                        f"row {r['id']}: token id {bad[0]} outside the target vocab of {self.vocab_size} "
                        "(tokenised with another tokenizer?)"
                    )
                is_long = len(ids) > self.max_len
                turns = [(None, {"input_ids": ids[: self.max_len], "loss_mask": mask[: self.max_len],
                                 "truncated": is_long})]
            else:
                conv.validate_messages(r["messages"], f"row {r['id']}")
                if not conv.has_assistant_turn(r):
                    return [dict(out, status="no_assistant_turn")]
                if self.channels is not None:  # gpt-oss: the effort the reply was regenerated at
                    turns = [(None, conv.tokenize_conversation(
                        self.tok, r["messages"], self.max_len, self.channels, r.get("reasoning_effort"),
                        cut=bool(r.get("cut")), template_kwargs=self.template_kwargs, where=f"row {r['id']}"))]
                else:
                    turns, unlabelled = conv.tokenize_turns(self.tok, r["messages"], self.max_len, bool(r.get("cut")),
                                                            self.template_kwargs, f"row {r['id']}", self.each)
                    out["unlabelled"] = len(unlabelled)
        except conv.DataError as exc:
            return [dict(out, status="invalid", error=str(exc))]
        return [self.row(t, out if k is None else dict(out, id=f"{out['id']}#turn{k}", turn=k, unlabelled=0))
                for k, t in turns]

    def row(self, t: dict, out: dict) -> dict:
        if t["truncated"]:
            if self.overlong == "drop":
                return dict(out, status="overlong_dropped")
            out = dict(out, truncated=True)
        n_asst = int(sum(t["loss_mask"]))
        if n_asst < 2:
            return dict(out, status="no_assistant_turn")
        return dict(out, input_ids=[int(x) for x in t["input_ids"]], loss_mask=[int(x) for x in t["loss_mask"]],
                    length=len(t["input_ids"]), assistant_tokens=n_asst)


def history_counts(mode: str, meta: dict, ok: Any) -> dict:
    """``stats.json``'s ``history_turns``: the conversations whose full row leaves earlier replies
    unlabelled (the chat template rewrites them as history), those replies, and the extra rows
    ``data.history_turns: each`` added for them (kept: trainable and within the over-long policy),
    from the map's ``meta`` columns and its ``ok`` rows; logged."""
    unlabelled, turn = np.asarray(meta["unlabelled"]), np.asarray(meta["turn"])
    counts = {"mode": mode, "conversations": int((unlabelled > 0).sum()),
              "replies": int(unlabelled.sum()), "rows_added": int(((turn >= 0) & ok).sum())}
    if counts["conversations"] and counts["mode"] == "each":
        log.info("data.history_turns=each: %d rows added for %d earlier replies of %d conversations whose chat template "
                 "rewrites them as history", counts["rows_added"], counts["replies"], counts["conversations"])
    elif counts["conversations"]:
        log.info("data.history_turns=last: %d earlier replies of %d conversations are unlabelled context (the chat "
                 "template rewrites them as history; 'each' trains them in rows of their own)", counts["replies"],
                 counts["conversations"])
    return counts
