"""Made-up inputs: secrets to look for in a run's files, lines of ``draftsmith proxy``'s traffic
log, multi-turn conversations to regenerate."""

from __future__ import annotations

import json
from pathlib import Path

# tokens set in the environment of a run, which must never reach its files or logs
FAKE = {
    "HF_TOKEN": "hf_FAKEtoken0000000000000000000001",
    "HUGGING_FACE_HUB_TOKEN": "hf_FAKEtoken0000000000000000000002",
    "WANDB_API_KEY": "FAKEwandbkey00000000000000000000000003",
    "MY_SERVICE_TOKEN": "FAKEservice000000000000000004",
}

# the model the traffic-log lines are served by
MODEL = "tiny-target"


def served(i: int, prompt: str, reply: str, *, model: str = MODEL, status: int = 200, finish: str = "stop",
           endpoint: str = "chat", temperature: float | None = 0.0, messages: list | None = None) -> dict:
    """One traffic-log line as ``draftsmith proxy`` writes it."""
    request = {"model": model, "max_tokens": 64, "temperature": temperature,
               **({"prompt": prompt} if endpoint == "completions" else
                  {"messages": messages if messages is not None else [{"role": "user", "content": prompt}]})}
    return {"version": 1, "id": f"r{i}", "time": 1.0 + i, "endpoint": endpoint, "model": model,
            "upstream": "upstream-0", "status": status, "request": request,
            "choices": [{"index": 0, "text": reply, "finish_reason": finish}] if status == 200 else [],
            "usage": None, "latency_s": 0.1}


def write_log(path: Path, rows: list, tail: str = "") -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows) + tail)
    return path


# a multi-turn conversation with a system prompt and a single-turn one, with replies to replace
MULTI = [
    {"id": "m", "messages": [{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": "Name a colour."},
                             {"role": "assistant", "content": "old reply"},
                             {"role": "user", "content": "And another one?"},
                             {"role": "assistant", "content": "old reply 2"}]},
    {"id": "s", "messages": [{"role": "user", "content": "What is the capital of Italy?"},
                             {"role": "assistant", "content": "old"}]},
]
