"""draftsmith plan --roofline: the cost table estimated from a GPU's datasheet and the target's
config.json (eval/serving_roofline.py), checked against figures worked by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from draftsmith.cli import plan as plan_cli
from draftsmith.eval import serving_roofline as roof
from draftsmith.hardware import H200
from draftsmith.target.facts import target_facts
from draftsmith.target.resolve import bundled_target_config

from test_serving_plan import profile

LLAMA = "meta-llama/Llama-3.1-8B-Instruct"
GPT_OSS = "openai/gpt-oss-120b"


def config(name: str) -> dict:
    return json.loads(bundled_target_config(name).read_text())


def test_a_dense_target_at_batch_one_reads_its_weights_once():
    """Llama-3.1-8B at batch 1: the step is the weights (less the untied input embedding) plus one
    sequence's KV cache over the context, at 4.8 TB/s: about 3.2 ms."""
    cfg = config(LLAMA)
    facts = target_facts(cfg)
    context = 1000
    kv = context * facts["kv_bytes_per_token"]
    expected = (facts["bytes"] - facts["bytes_by_part"]["embedding"] + kv) / 4.8e12
    t = roof.TargetRoofline(cfg, H200, context_tokens=context)
    assert t.seconds(1, 1) == pytest.approx(expected, rel=1e-9)
    assert 3.0e-3 < expected < 3.5e-3
    # memory-bound: verifying 4 positions of one sequence costs the same
    assert t.seconds(4, 1) == pytest.approx(t.seconds(1, 1), rel=1e-9)
    # compute-bound at 4096 positions: 2 x active parameters per position over 989 TFLOP/s, at least
    assert t.seconds(4096, 1) >= 4096 * 2 * t.active_params / 989e12


def test_moe_experts_touched_grow_with_the_positions_verified():
    assert roof.experts_touched(1, 128, 4) == pytest.approx(4.0)
    assert roof.experts_touched(10_000, 128, 4) == pytest.approx(128.0)
    assert roof.experts_touched(8, 0, 0) == 0.0
    # gpt-oss-120b: verifying K + 1 = 4 positions at batch 1 reads more experts, so it costs more
    # than one position, where the dense Llama pays nothing for it (the MoE "speculation is slower"
    # reports)
    moe = roof.TargetRoofline(config(GPT_OSS), H200, context_tokens=512)
    dense = roof.TargetRoofline(config(LLAMA), H200, context_tokens=512)
    assert moe.seconds(4, 1) / moe.seconds(1, 1) > 1.5
    assert dense.seconds(4, 1) / dense.seconds(1, 1) < 1.01


def test_chain_drafters_pay_k_passes_block_drafters_one_and_ngram_none(tmp_path):
    save_file({"w": torch.zeros(1000, 1000)}, str(tmp_path / "model.safetensors"))
    params, nbytes = roof.draft_size(tmp_path)
    assert (params, nbytes) == (1_000_000, 2_000_000)
    one = nbytes / 4.8e12
    assert roof.draft_seconds(params, nbytes, H200, 1, 3, chain=True) == pytest.approx(3 * one)
    assert roof.draft_seconds(params, nbytes, H200, 1, 3, chain=False) == pytest.approx(one)
    assert roof.draft_size(None) == (0, 0) and roof.draft_seconds(0, 0, H200, 8, 3, chain=True) == 0.0
    table = roof.roofline_costs(config(LLAMA), H200, [0, 3], [1, 8], draft=None, chain=True, context_tokens=256,
                                target=LLAMA, method="ngram")
    assert table.source.startswith("roofline (estimate")
    assert sorted((c.batch_size, c.k) for c in table.costs) == [(1, 0), (1, 3), (8, 0), (8, 3)]


def test_the_command_plans_from_the_roofline_and_names_it(tmp_path, capsys):
    prof = profile([0.6, 0.4, 0.2], method="ngram", target=LLAMA)
    (tmp_path / "profile.json").write_text(prof.model_dump_json())
    out = tmp_path / "plan.json"
    base = ["--method", "ngram", "--profile", str(tmp_path / "profile.json"), "--target", LLAMA, "--out", str(out),
            "--batch-sizes", "1,16,256", "--vllm", "0.32.0"]
    assert plan_cli.main([*base, "--roofline", "h200"]) == 0, capsys.readouterr().err
    plan = json.loads(out.read_text())
    assert plan["sources"]["cost_table"] == "roofline h200"
    assert plan["sources"]["step_cost"].startswith("roofline (estimate")
    assert plan["chosen"]["1"]["k"] == 3  # memory-bound Llama at batch 1: free verification, the largest K
    assert "roofline (estimate" in capsys.readouterr().out
    assert not (tmp_path / "cost_table.json").exists()  # an estimate never takes a measurement's place
    out.unlink()
    assert plan_cli.main([*base, "--roofline", "tpu"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--roofline tpu" in err and "h200" in err and not out.exists()


def test_an_unknown_gpu_is_named():
    with pytest.raises(roof.PlanError, match="b300"):
        roof.gpu_named("b300")
    assert roof.gpu_named("H200") is H200
    assert Path(bundled_target_config(LLAMA)).is_file()
