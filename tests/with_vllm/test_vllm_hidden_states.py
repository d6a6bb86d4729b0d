"""The vLLM hidden-state engine (``extract_hidden_states``) against the transformers engine,
and the ``data.hidden_states_engine`` selection."""

from __future__ import annotations

import importlib.util
import math
import time
from pathlib import Path

import pytest
import torch

from draftsmith.target import vllm_capture as vhs
from draftsmith.target.capture import TransformersCapture
from draftsmith.train.data import HiddenStateDataset
from draftsmith.data_prep.prepare import prepare
from draftsmith.target import load_target
from draftsmith.models.eagle3.training import Eagle3Method
from draftsmith.train.trainer import fit

from helpers.tiny import TINY_AUX, write_jsonl
from helpers.recipes import PROMPTS, tiny_recipe

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed")


@pytest.fixture(scope="module")
def vllm_run(tiny_target, tmp_path_factory):
    run = tmp_path_factory.mktemp("vllm_hs_run")
    prompts = write_jsonl(run / "prompts.jsonl", [{"id": f"p{i}", "prompt": p} for i, p in enumerate(PROMPTS)])
    recipe = tiny_recipe(tiny_target, prompts, max_steps=2)
    recipe.data.hidden_states_engine = "vllm"
    recipe.data.hidden_states_dtype = "float32"
    recipe.vllm.max_model_len = 256
    summary = prepare(recipe, run)
    return recipe, run, summary


@pytest.mark.vllm
@needs_vllm
def test_vllm_engine_states_match_the_transformers_engine(vllm_run, tiny_target):
    recipe, run, _ = vllm_run
    ds = HiddenStateDataset(run / "data" / "hidden_states")
    assert ds.manifest["engine"] == "vllm"
    from draftsmith.layout import DataPaths, read_tokenized

    records = read_tokenized(DataPaths(run / "data"), format=None).to_list()
    assert len(ds) == len(records) > 0
    model, _ = load_target(tiny_target)
    ref = {j: (aux, final) for j, aux, final in TransformersCapture(model, TINY_AUX).capture(records)}
    H = model.config.hidden_size
    from draftsmith.train.validation import dataset_ids

    position = {rid: k for k, rid in enumerate(dataset_ids(ds))}  # shards store records in arrival order
    for i, (aux, final) in sorted(ref.items()):
        item = ds[position[records[i]["id"]]]
        assert item["input_ids"].tolist() == records[i]["input_ids"]
        for got, want in ((item["aux_hidden_states"], aux), (item["final_hidden_states"], final)):
            # fp32 on CPU, different kernels: max |diff| per token relative to that token's state norm
            scale = want.reshape(len(want), -1, H).norm(dim=-1).repeat_interleave(H, dim=-1)  # (T, kH)
            assert ((got - want).abs() / scale).max() < 1e-3, i


@pytest.mark.vllm
@needs_vllm
def test_a_training_step_runs_on_vllm_captured_shards(vllm_run):
    recipe, run, summary = vllm_run
    assert summary["hidden_states"]["tokens"] > 0
    result = fit(recipe, Eagle3Method(recipe, run), run, progress=False)
    assert result.steps == 2
    assert math.isfinite(result.last_metrics["loss"]) and result.last_metrics["loss"] > 0


# --- the engine itself: work dir, bounded sub-batches, errors, shutdown ---------------------------

def engine_processes() -> list[str]:
    """Command lines of this process's descendants that are vLLM engine processes (spawned
    children run ``spawn_main``; vLLM retitles them ``VLLM::EngineCore`` when it can)."""
    psutil = pytest.importorskip("psutil")
    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
            if ("EngineCore" in cmd or "spawn_main" in cmd) and p.status() != psutil.STATUS_ZOMBIE:
                found.append(cmd)
        except psutil.NoSuchProcess:
            pass
    return found


@pytest.fixture(scope="module")
def capture_engine(tiny_target, tmp_path_factory):
    from draftsmith.recipe import VllmConfig

    from helpers.tiny import CPU_VLLM

    work = tmp_path_factory.mktemp("vllm_capture") / "hidden_states" / ".vllm-work"
    work.mkdir(parents=True)
    for stale in ("killed-req.safetensors", "killed-req.safetensors.lock"):  # a killed run's leftovers
        (work / stale).write_bytes(b"x")
    engine = vhs.VllmHiddenStateCapture(tiny_target, TINY_AUX, VllmConfig(**dict(CPU_VLLM, max_model_len=256)),
                                        work_dir=work, batch_tokens=64)
    yield engine, work
    engine.close()


@pytest.mark.vllm
@needs_vllm
def test_capture_engine_reads_bounded_sub_batches_from_its_work_dir_and_closes(capture_engine, tiny_target,
                                                                               monkeypatch):
    import tempfile

    from vllm.distributed.kv_transfer.kv_connector.v1 import example_hidden_states_connector as conn

    engine, work = capture_engine
    assert list(work.iterdir()) == []  # leftovers removed at start
    temp_before = set(Path(tempfile.gettempdir()).glob("draftsmith-vllm-hs-*"))
    g = torch.Generator().manual_seed(0)
    records = [{"id": f"r{i}", "input_ids": torch.randint(0, 512, (n,), generator=g).tolist()}
               for i, n in enumerate([20, 30, 10, 40, 25, 5, 33, 18])]
    subs = [len(s) for s in engine.sub_batches(records)]
    assert len(subs) > 2
    held = []
    load = conn.load_hidden_states

    def counting_load(path):
        held.append(len(list(work.glob("*.safetensors"))))
        return load(path)

    monkeypatch.setattr(conn, "load_hidden_states", counting_load)
    got = {}
    for j, aux, final in engine.capture(records):
        assert aux.device == final.device == engine.device
        got[j] = (aux.float().cpu(), final.float().cpu())
    assert sorted(got) == list(range(len(records)))
    assert 0 < max(held) <= max(subs) < len(records)  # never more than one sub-batch of files at once
    assert list(work.iterdir()) == []
    assert set(Path(tempfile.gettempdir()).glob("draftsmith-vllm-hs-*")) == temp_before

    model, _ = load_target(tiny_target)
    H = model.config.hidden_size
    for j, aux, final in TransformersCapture(model, TINY_AUX).capture(records):
        for a, b in ((got[j][0], aux), (got[j][1], final)):  # fp32 on CPU, different kernels (as above)
            scale = b.reshape(len(b), -1, H).norm(dim=-1).repeat_interleave(H, dim=-1)
            assert ((a - b).abs() / scale).max() < 1e-3, j

    assert engine_processes()
    engine.close()
    engine.close()  # idempotent
    deadline = time.monotonic() + 30
    while engine_processes() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert engine_processes() == []
    assert not work.exists()  # the given work dir, empty, is removed with the engine
