"""The regeneration engine that talks to a real ``vllm serve`` regenerates multi-turn
conversations turn by turn (the client against a fake server is tests/unit/test_regenerate_server.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers.tiny import CPU_VLLM
from helpers.fake_inputs import MULTI
from draftsmith.data_prep import chat_engines, regenerate as regen
from draftsmith.recipe import VllmConfig


def cached_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.vllm
def test_server_engine_regenerates_multi_turn_conversations_turn_by_turn(tiny_target, tmp_path):
    cache = tmp_path / "regen.jsonl"
    base = {"target": regen.target_id(str(tiny_target), tiny_target), "chat_template_sha256": "x", "engine": "vllm"}
    engines = []

    def make():
        engine = VllmConfig(**dict(CPU_VLLM, max_model_len=512))  # the tiny target's context is 1024
        engines.append(chat_engines.ServerChatEngine(tiny_target, 0, engine, concurrency=4, log_path=tmp_path / "server.log"))
        return engines[0]

    out = regen.regenerate(MULTI, cache, make, [0.0], 8, progress=False, fingerprint_base=base)
    roles = [m["role"] for m in out[0]["messages"]]
    assert roles == ["system", "user", "assistant", "user", "assistant"]
    assert all(m["content"] not in ("old reply", "old reply 2") for m in out[0]["messages"])
    assert [m["role"] for m in out[1]["messages"]] == ["user", "assistant"]
    rows = cached_rows(cache)
    assert sorted(r["id"] for r in rows) == ["m", "s"]  # one row per conversation
    for r in rows:
        assert r["fingerprint"] == regen.fingerprint(base, 0.0, 8, None)
        assert r["fingerprint_id"] == regen.fingerprint_id(r["fingerprint"])
    assert engines[0].completion_tokens > 0
    # the server was stopped when regeneration ended
    with pytest.raises(Exception):
        chat_engines.ServerChatEngine(None, server_urls=[engines[0].urls[0]], max_retries=0).generate(
            [[{"role": "user", "content": "hi"}]], [0.0], 4)
