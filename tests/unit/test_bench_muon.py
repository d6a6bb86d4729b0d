"""``benchmarks/muon.py`` (``make bench-muon``) end to end on a tiny Llama target: the three rows
(AdamW, torch's Muon, draftsmith's Muon in the detected Newton-Schulz dtype), their table and JSON."""

from __future__ import annotations

import json

import torch

from benchmarks.muon import main
from draftsmith.train.optim import newton_schulz_dtype

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0}


def test_tiny_run_times_the_three_optimizers(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY))
    out = tmp_path / "bench_muon.json"
    threads = torch.get_num_threads()
    try:
        code = main(["--target-config", str(config), "--set", "data.draft_vocab_size=256", "--set",
                     "data.aux_layer_ids=[1,2,3]", "--batch-size", "2", "--max-length", "32", "--steps", "2",
                     "--warmup", "1", "--threads", "1", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    result = json.loads(out.read_text())
    detected = str(newton_schulz_dtype("cpu")[0]).removeprefix("torch.")
    assert result["environment"]["detected_ns_dtype"] == detected
    adamw, torch_muon, ours = result["rows"]
    assert [r["optimizer"] for r in result["rows"]] == ["adamw", "muon", "muon"]
    assert adamw["ns_dtype"] is None and adamw["muon_parameters"] == 0
    assert torch_muon["ns_dtype"] == "bfloat16" and ours["ns_dtype"] == detected
    assert torch_muon["muon_parameters"] == ours["muon_parameters"] > 0
    for r in result["rows"]:
        assert (r["batch_size"], r["max_length"], r["precision"]) == (2, 32, "fp32")
        assert len(r["seconds"]) == 2 and r["seconds_per_step"] >= r["optimizer_seconds_per_step"] > 0
    assert adamw["vs_adamw"] == 1.0 and result["meets_bar"] == (ours["vs_adamw"] <= result["bar"])
    table = capsys.readouterr().out
    assert f"| muon (draftsmith, {detected} NS) |" in table and "| muon (torch, bf16 NS) |" in table
