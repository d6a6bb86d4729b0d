"""fp32 master weights where the GPU recipes train in bf16 (issue 51, deliverable 5).

Each case is one CPU process (world size 1) of the real trainer under the launcher the GPU
recipes name, with the GPU recipes' optimizer settings (recipes/gptoss120b.yaml: DeepSpeed ZeRO-2;
recipes/llama3_1_8b.yaml: FSDP2; single_gpu.yaml: plain bf16 autocast), after one optimizer step
(tests/helpers/master_weights.py):

1. bf16 autocast (accelerate ``mixed_precision: bf16``): the draft's parameters stay fp32, the
   linear layers compute in bf16, AdamW's ``exp_avg`` / ``exp_avg_sq`` and Muon's momentum are fp32.
2. DeepSpeed ZeRO-2 with bf16: the module's weights are bf16 (compute), the optimizer steps fp32
   partitions (the masters) whose Adam moments are fp32.
3. FSDP2 with ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``: the sharded
   parameters (the masters) and their moments are fp32, the layers compute in bf16.

In each, some master elements take an update smaller than half their bf16 spacing: bf16 weights
would have dropped it. A draft cast to bf16 before the optimizer is built fails the same check
(``test_a_draft_cast_to_bf16_fails_the_check``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from draftsmith.recipe import dump_recipe

pytestmark = pytest.mark.integration  # the real trainer, one process per launcher

REPO = Path(__file__).resolve().parents[2]
GPU_RECIPE = {"autocast": "llama3_1_8b.yaml", "deepspeed": "gptoss120b.yaml", "fsdp2": "llama3_1_8b.yaml"}
PRECISION_KEYS = ("optimizer", "lr", "betas", "weight_decay", "max_grad_norm")


def run_case(prepared, tmp_path: Path, case: str, *extra: str) -> dict:
    """The report of one case (tests/helpers/master_weights.py) on a copy of the prepared run,
    with the optimizer keys of the GPU recipe the case stands for."""
    recipe, run, _ = prepared
    gpu = yaml.safe_load((REPO / "recipes" / GPU_RECIPE[case]).read_text())["train"]
    keys = {k: tuple(gpu[k]) if isinstance(gpu[k], list) else gpu[k] for k in PRECISION_KEYS if k in gpu}
    recipe = recipe.model_copy(update={"train": recipe.train.model_copy(update=keys)})
    name = "-".join([case, *(e.strip("-") for e in extra)])
    work = tmp_path / name
    shutil.copytree(run, work / "run")
    dump_recipe(recipe, work / "recipe.yaml")
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "helpers.master_weights", case, str(work / "run"),
                           str(work / "recipe.yaml"), str(work / "report.json"), *extra],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads((work / "report.json").read_text())


def fp32_master_problems(r: dict) -> list[str]:
    """What is wrong with a report for fp32 masters and bf16 compute ([] when nothing)."""
    problems = []
    if not r["stepped"] or not r["masters_changed"]:
        problems.append("no optimizer step changed the masters")
    if r["master_dtypes"] != ["float32"]:
        problems.append(f"master parameters are {r['master_dtypes']}")
    for key, dtypes in r["moment_dtypes"].items():
        if dtypes != ["float32"]:
            problems.append(f"optimizer {key} is {dtypes}")
    if not r["moment_dtypes"]:
        problems.append("no optimizer moments")
    if r["compute_dtypes"] != ["bfloat16"]:
        problems.append(f"the linear layers computed in {r['compute_dtypes']}")
    return problems


@pytest.mark.parametrize("case, expect", [
    ("autocast", {"distributed_type": "NO", "module_param_dtypes": ["float32"]}),
    ("deepspeed", {"distributed_type": "DEEPSPEED", "module_param_dtypes": ["bfloat16"]}),
    ("fsdp2", {"distributed_type": "FSDP", "module_param_dtypes": ["float32"]}),
])
def test_the_gpu_recipes_keep_fp32_masters_and_moments_and_compute_in_bf16(prepared, tmp_path, case, expect):
    r = run_case(prepared, tmp_path, case)
    assert {k: r[k] for k in expect} == expect, r
    assert r["mixed_precision"] == "bf16", r
    assert fp32_master_problems(r) == [], r
    assert set(r["moment_dtypes"]) == {"exp_avg", "exp_avg_sq"}, r
    # the masters kept updates that bf16 weights would have rounded away
    assert r["updates_below_half_bf16_spacing"] > 0, r


@pytest.mark.parametrize("case", ["autocast", "fsdp2"])  # DeepSpeed steps one optimizer: muon is refused there
def test_muon_momentum_is_fp32(prepared, tmp_path, case):
    r = run_case(prepared, tmp_path, case, "--optimizer", "muon")
    assert r["optimizers"] == ["AdamW", "Muon"], r
    assert fp32_master_problems(r) == [], r
    assert r["moment_dtypes"]["momentum_buffer"] == ["float32"], r


def test_a_draft_cast_to_bf16_fails_the_check(prepared, tmp_path):
    r = run_case(prepared, tmp_path, "autocast", "--cast-draft-bf16")
    problems = fp32_master_problems(r)
    assert "master parameters are ['bfloat16']" in problems, r
    assert "optimizer exp_avg is ['bfloat16']" in problems, r
