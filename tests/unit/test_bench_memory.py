"""``draftsmith bench memory``: the live-bytes tracker, fake tensors against a real step, the
command's output and bad input, and the dry run's estimate against the measurement for every
shipped GPU recipe."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import torch

from benchmarks.memory import MemoryTracker, Precision, bench_recipe, main, measure_step
from draftsmith.recipe import load_recipe

RECIPES = Path(__file__).parents[2] / "recipes"

# a tiny Llama target: every method builds its draft from it in a fraction of a second
TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0}
TINY_SETS = ["data.draft_vocab_size=256", "data.aux_layer_ids=[1,2,3]", "train.batch_size=2", "data.max_length=32"]


def tiny_config(tmp_path: Path, **changes) -> Path:
    cfg = {k: v for k, v in {**TINY, **changes}.items() if v is not None}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return path


# -- the tracker


def test_tracker_peak_of_a_known_sequence_counts_storages_not_views():
    with MemoryTracker() as t:
        a = torch.empty(1000, dtype=torch.float32)  # 4000 B
        views = [a.view(10, 100), a[::2], a.t() if a.dim() == 2 else a.unsqueeze(0), a.reshape(100, 10)]
        assert t.current == 4000  # views share a's storage
        b = torch.empty(500, dtype=torch.float64)  # + 4000
        assert (t.current, t.peak) == (8000, 8000)
        del b
        gc.collect()
        assert (t.current, t.peak) == (4000, 8000)
        c = torch.empty(250, dtype=torch.int8)  # + 250
        del a
        gc.collect()
        assert t.current == 4250  # a's storage lives on in its views
        del views
        gc.collect()
        assert t.current == 250
    assert t.peak == 8000
    del c


def test_tracker_keeps_what_autograd_saved_and_breaks_a_phase_down():
    with MemoryTracker() as t:
        x = torch.ones(256, requires_grad=True)  # 1024 B
        t.track(x)
        with t.phase("forward"):
            y = x.exp()  # 1024 B, saved by ExpBackward
            z = y.sum()  # 4 B
            del y
            gc.collect()
        assert t.current == 1024 + 1024 + 4  # y freed by the program but kept for backward
        assert t.phases["forward"].bytes == 1024 + 1024 + 4
        serial_x = t.serial(x)
        peak, live = t.weighted_peak("forward", {})
        assert peak == 1024 + 1024 + 4
        assert t.breakdown(live, {"weights": {serial_x}}) == {"weights": 1024, "activations": 1028, "total": 2052}
        # not counting x (weight 0), the peak is the same moment, 1028 bytes
        assert t.weighted_peak("forward", {serial_x: 0.0})[0] == 1028
        z.backward()
        del z
        gc.collect()
        assert t.current == 1024 + 1024  # x and its gradient; y is gone
        t.exclude([x])
        assert t.current == 1024


def test_weighted_peak_finds_the_moment_a_weighted_count_peaks():
    """Counting storage a at 0 (state a launcher shards) moves the peak to another moment."""
    with MemoryTracker() as t:
        with t.phase("p"):
            a = torch.empty(1000, dtype=torch.uint8)
            sa = t.serial(a)
            b = torch.empty(300, dtype=torch.uint8)  # 1300
            del b
            gc.collect()
            c = torch.empty(500, dtype=torch.uint8)  # 1500: the plain peak
            del a
            gc.collect()
            d = torch.empty(600, dtype=torch.uint8)  # 1100, all of it not a
    assert t.phases["p"].bytes == 1500
    peak, live = t.weighted_peak("p", {})
    assert peak == 1500 and live == {sa, t.serial(c)}
    without_a, live = t.weighted_peak("p", {sa: 0.0})
    assert without_a == 1100 and live == {t.serial(c), t.serial(d)}
    assert t.breakdown(live, {"c": {t.serial(c)}}) == {"c": 500, "activations": 600, "total": 1100}


def test_tracker_under_fake_tensors_matches_real_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    def program():
        w = torch.empty(64, 32, requires_grad=True)
        h = torch.empty(8, 64).relu() @ w  # (8, 32)
        mask = torch.tensor([True, False] * 4)  # real: boolean indexing keeps its true shape
        loss = h[mask].float().pow(2).sum()
        loss.backward()

    with MemoryTracker() as real:
        program()
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    with fake_mode, MemoryTracker(fake=fake_mode) as fake:
        program()
    assert fake.peak == real.peak > 64 * 32 * 4


@pytest.mark.parametrize("method, recipe", [("eagle3", "smollm2_135m"), ("dflash", "smollm2_135m_dflash"),
                                            ("medusa", "smollm2_135m_medusa"), ("dspark", "smollm2_135m_dspark")])
def test_fake_step_measures_what_the_real_step_allocates(method, recipe):
    # the chunked loss on both: a fake step models the GPU's fused loss, which a real CPU step cannot run
    sets = TINY_SETS + ["train.fused_loss=false"] + (["draft.num_anchors=8", "draft.block_size=4"]
                                                     if method in ("dflash", "dspark") else [])
    r = bench_recipe(load_recipe(RECIPES / f"{recipe}.yaml", sets), 2, 32)
    fake = measure_step(r, TINY, None, Precision.of(None, "fp32"), device="fake")
    real = measure_step(r, TINY, None, Precision.of(None, "fp32"), device="cpu")
    assert fake.process_peak_bytes == real.process_peak_bytes
    assert fake.phases == real.phases
    ph = fake.phases["forward_backward"]
    assert ph["activations"] > 0 and ph["weights"] == 4 * fake.trainable_parameters
    assert fake.phases["optimizer"]["optimizer_state"] >= 8 * fake.trainable_parameters  # exp_avg + exp_avg_sq


def test_muon_step_measures_momentum_and_the_guards_copies():
    """``train.optimizer: muon``: the measured optimizer state is AdamW's two moments over the
    parameters Muon does not take, plus, over the hidden matrices, Muon's momentum and the
    non-finite guard's copies of weights and momentum (12 B); the dry run's 12 B per trainable
    parameter bounds it, and the fake step still measures what the real one allocates."""
    from draftsmith.train.dry_run import state_bytes_per_gpu
    from draftsmith.train.components.optimizer import split_muon_params
    from benchmarks.memory import offline_method, random_weights

    r = bench_recipe(load_recipe(RECIPES / "smollm2_135m.yaml", TINY_SETS + ["train.optimizer=muon",
                                                                        "train.fused_loss=false"]), 2, 32)
    fake = measure_step(r, TINY, None, Precision.of(None, "fp32"), device="fake")
    real = measure_step(r, TINY, None, Precision.of(None, "fp32"), device="cpu")
    assert fake.phases == real.phases
    with offline_method(r, TINY, torch.float32, random_weights) as method:
        muon, adamw = split_muon_params(method.build_model())
    n_muon, n_adamw = sum(p.numel() for p in muon), sum(p.numel() for p in adamw)
    assert n_muon > 0 and n_muon + n_adamw == fake.trainable_parameters
    state = fake.phases["optimizer"]["optimizer_state"]
    expected = 8 * n_adamw + 12 * n_muon
    assert expected <= state <= expected + 4096  # + the step counters
    assert state <= state_bytes_per_gpu(fake.trainable_parameters, None, "fp32", "muon")["optimizer_state"]
    assert fake.state_per_gpu["optimizer_state"] == 12 * fake.trainable_parameters
    adamw_run = measure_step(bench_recipe(load_recipe(RECIPES / "smollm2_135m.yaml", TINY_SETS + ["train.optimizer=adamw"]),
                                          2, 32), TINY, None, Precision.of(None, "fp32"), device="fake")
    assert adamw_run.phases["optimizer"]["optimizer_state"] < state


# -- the command


def test_bench_memory_json_prints_one_object_per_length(tmp_path, capsys):
    cfg = tiny_config(tmp_path)
    rc = main([str(RECIPES / "smollm2_135m.yaml"), "--target-config", str(cfg), "--json", "--batch-size", "2",
               "--max-length", "16", "32", "--set", "data.draft_vocab_size=256", "--set", "data.aux_layer_ids=[1,2,3]"])
    assert rc == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["max_length"] for r in rows] == [16, 32]
    for r in rows:
        assert r["batch_size"] == 2 and r["method"] == "eagle3"
        assert r["measured_bytes"] > 0 and r["estimated_bytes"] > 0
        assert r["process_peak_bytes"] > 0 and r["precision"] == "fp32" and r["device"] == "fake"
        assert set(r["measured_phases"]) == {"forward_backward", "optimizer"}
        assert r["largest_at_peak"] and {"bytes", "count", "what"} <= set(r["largest_at_peak"][0])
    assert rows[1]["measured_bytes"] > rows[0]["measured_bytes"]  # longer sequences, more activations
    assert list(tmp_path.iterdir()) == [cfg]  # nothing written


@pytest.mark.parametrize("recipe, setting, want", [("smollm2_135m_dflash", "auto", "fused"),
                                                    ("smollm2_135m_dflash", "false", "chunked"),
                                                    ("smollm2_135m_dspark", "auto", "chunked")])
def test_bench_memory_reports_the_loss_the_step_ran_beside_the_one_estimated(tmp_path, capsys, recipe, setting, want):
    """The fake GPU step runs the fused loss where the method's loss is ``chunked_distill`` and
    ``train.fused_loss`` allows it (DSpark computes its own); each row names the loss measured
    (``loss_path``) and the one the dry run's estimate counts (``estimated_loss_path``)."""
    cfg = tiny_config(tmp_path)
    rc = main([str(RECIPES / f"{recipe}.yaml"), "--target-config", str(cfg), "--json", "--batch-size", "2",
               "--max-length", "32", "--set", "data.draft_vocab_size=256", "--set", "data.aux_layer_ids=[1,2,3]",
               "--set", "draft.num_anchors=8", "--set", "draft.block_size=4", "--set", f"train.fused_loss={setting}"])
    assert rc == 0
    (row,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert row["loss_path"] == row["estimated_loss_path"] == row["estimate"]["loss_path"] == want


def test_bench_memory_text_output(tmp_path, capsys):
    cfg = tiny_config(tmp_path)
    rc = main([str(RECIPES / "smollm2_135m_medusa.yaml"), "--target-config", str(cfg), "--batch-size", "2",
               "--max-length", "16", "--set", "data.draft_vocab_size=256", "--set", "data.aux_layer_ids=[1,2,3]"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "smollm2_135m_medusa (medusa)" in out and "per GPU" in out and "estimate" in out


@pytest.mark.parametrize("key", ["hidden_size", "num_attention_heads", "intermediate_size", "vocab_size",
                                 "max_position_embeddings"])
def test_bench_memory_refuses_a_config_without_a_geometry_key(tmp_path, capsys, key):
    cfg = tiny_config(tmp_path, **{key: None})
    rc = main([str(RECIPES / "smollm2_135m.yaml"), "--target-config", str(cfg), "--max-length", "16"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1 and key in err[0] and str(cfg) in err[0]


def test_bench_memory_refuses_a_length_beyond_the_target(tmp_path, capsys):
    cfg = tiny_config(tmp_path)
    rc = main([str(RECIPES / "smollm2_135m.yaml"), "--target-config", str(cfg), "--max-length", "64", "512"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1
    assert "--max-length=512" in err[0] and "max_position_embeddings=256" in err[0]


def test_bench_memory_refuses_a_missing_config(tmp_path, capsys):
    rc = main([str(RECIPES / "smollm2_135m.yaml"), "--target-config", str(tmp_path / "none.json")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1 and "--target-config" in err[0]


def test_cli_routes_bench_memory(tmp_path, capsys):
    from draftsmith.cli import main as cli_main

    assert cli_main(["bench"]) == 2
    cfg = tiny_config(tmp_path, vocab_size=None)
    assert cli_main(["bench", "memory", str(RECIPES / "smollm2_135m.yaml"), "--target-config", str(cfg)]) == 1
    assert "vocab_size" in capsys.readouterr().err


# -- the dry run against the measurement
