"""The ``draftsmith synthesize`` command line runs the transformers engine on the given device and
accepts the vLLM engine flags."""

from __future__ import annotations
import json

import pytest

from draftsmith.cli.synthesize import main

from helpers.tiny import CPU_VLLM_FLAGS


@pytest.mark.integration
def test_cli_runs_the_transformers_engine_on_the_given_device_and_accepts_the_vllm_flags(tiny_target, tmp_path, capsys):
    out = tmp_path / "magpie.jsonl"
    assert main(["--target", str(tiny_target), "--num-prompts", "2", "--out", str(out), "--engine", "transformers",
                 "--device", "cpu", "--max-tokens", "8", "--batch-size", "4", *CPU_VLLM_FLAGS]) == 0
    counts = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert counts["sampled"] > 0 and out.is_file()
    assert len(out.read_text().splitlines()) == counts["kept"]
