"""``benchmarks/gpu.py`` (``make bench-gpu``) on the CPU: the whole path end to end at a tiny
geometry (the SmolLM2-135M recipes of EAGLE-3, DFlash, P-EAGLE and DSpark at 1 x 64, so it does not
first fail on a booked GPU), the credited FLOPs against torch's FLOP counter, the attention pair
counts against the dense masks of the three drafts, the device peak table and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks import gpu as bench_gpu
from benchmarks.gpu import cod_allowed_pairs, device_peak_tflops, dflash_pairs, main, ttt_pairs
from draftsmith.models.dflash.model import block_attention_mask
from draftsmith.models.eagle3.model import ttt_attention_mask
from draftsmith.models.peagle.model import cod_attention_mask
from draftsmith.models.dflash.training import sample_anchors
from draftsmith.models.peagle.training import cod_sample, step0_prediction_mask
from draftsmith.recipe import load_recipe

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


@pytest.fixture
def one_thread():
    """One intra-op thread: the tiny steps are dispatch-bound, and extra threads only contend."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_tiny_cpu_run_measures_every_method_end_to_end(tmp_path, capsys, one_thread):
    out = tmp_path / "bench.json"
    assert main(["--tiny", "--device", "cpu", "--steps", "1", "--warmup", "0", "--lengths", "full", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    table = capsys.readouterr().out
    assert result["settings"]["backends"] == ["sdpa"] and result["settings"]["peak_tflops"] is None
    rows = result["rows"]
    assert [(r["recipe"], r["method"], r["attention_backend"]) for r in rows] == [
        ("smollm2_135m", "eagle3", "sdpa"), ("smollm2_135m_dflash", "dflash", "sdpa"),
        ("smollm2_135m_peagle", "peagle", "sdpa"), ("smollm2_135m_dspark", "dspark", "sdpa")]
    for r in rows:
        assert r["error"] is None and (r["batch_size"], r["max_length"], r["precision"]) == (1, 64, "fp32")
        assert r["positions_per_s"] == r["useful_tokens_per_s"] > 0 and r["ms_per_step"] > 0 and r["mfu"] is None
        assert r["cuda_max_allocated"] is None and r["per_gpu"] is None  # CUDA figures only on CUDA
        assert r["fake_process_peak"] > 0 and r["fake_per_gpu"] > 0  # bench memory's reference, one process
        assert r["trainable_parameters"] > 0 and r["final_metrics"]["loss"] > 0
        f = r["flops"]
        assert min(f["linear"], f["attention"], f["teacher"]) > 0
        assert f["total"] == pytest.approx(f["linear"] + f["attention"] + f["teacher"])
        assert r["tflop_per_step"] == pytest.approx(f["total"] / 1e12)
        assert f"| {r['recipe']} | {r['method']} | sdpa | 1 x 64 |" in table
    eagle3, dflash, peagle, dspark = rows
    # unpacked rows, T = 64, K = 3: the causal block per step plus one diagonal per earlier step
    assert eagle3["flops"]["attention_pairs"] == 3 * 64 * 65 // 2 + 64 * 3
    assert dflash["flops"]["valid_anchors"] == 63 and peagle["flops"]["cod_elements"] > 64
    # DSpark scores every slot of a block (sample_from_anchor), DFlash all but the anchor's
    for r in (dflash, dspark):
        f = r["flops"]
        slots = f["block_size"] - (r["method"] == "dflash")
        assert f["lm_head_rows"] == f["anchors"] * slots, r["method"]
    capture = result["capture"]
    assert len(capture) == 1 and capture[0]["skipped"] is None  # one target for the four recipes
    names = [r["name"] for r in capture[0]["rows"]]
    assert names == ["target plain forward (logits)", "target decoder only (no lm_head)",
                     "capture aux (2, 15, 27) + final"]
    plain, decoder, cap = capture[0]["rows"]
    assert cap["tflop_per_step"] == decoder["tflop_per_step"] < plain["tflop_per_step"]
    assert "capture / plain forward" in table


def test_credited_flops_are_what_torch_counts_less_attention_plus_the_loss_recompute(tmp_path, one_thread):
    """On the CPU torch's FLOP counter sees every matmul of the step but no attention kernel; it
    also counts the chunked loss's recomputation of the logits in backward (``2 * P_lm_head`` per
    row; DSpark's chunk also recomputes its Markov bias ``[Vd, r]`` and confidence head ``[1, H + r]``),
    which MFU does not credit. What remains must be the credited linear + teacher FLOPs."""
    out = tmp_path / "bench.json"
    assert main(["--tiny", "--device", "cpu", "--steps", "1", "--warmup", "0", "--no-capture", "--no-fake",
                 "--lengths", "full", "--out", str(out)]) == 0
    recipe = load_recipe(RECIPES / "smollm2_135m.yaml")
    H, Vd = 576, recipe.data.draft_vocab_size  # SmolLM2-135M's hidden size
    for r in json.loads(out.read_text())["rows"]:
        f = r["flops"]
        per_row = H * Vd
        if r["method"] == "dspark":
            rank = load_recipe(RECIPES / "smollm2_135m_dspark.yaml").draft.markov_rank
            per_row += rank * Vd + H + rank
        recompute = 2.0 * per_row * f["lm_head_rows"]
        counted = r["counted_tflop_per_step"] * 1e12
        # P-EAGLE's fc over its one mask_hidden row (6 * 3H * H) is not credited either: < 1e-3
        assert counted == pytest.approx(f["linear"] + f["teacher"] + recompute, rel=1e-3), r["recipe"]


def documents(B: int, T: int) -> torch.Tensor:
    """Packed rows: three documents of different lengths per row (contiguous runs)."""
    docs = torch.zeros(B, T, dtype=torch.long)
    for b in range(B):
        docs[b, T // 3 + b:] = 1
        docs[b, 2 * T // 3 + 2 * b:] = 2
    return docs


@pytest.mark.parametrize("packed", [False, True])
def test_ttt_pairs_equal_the_dense_ttt_masks(packed):
    B, T, K = 2, 24, 4
    docs = documents(B, T) if packed else None
    dense = sum(int(ttt_attention_mask(T, k, None, docs).expand(B, T, (k + 1) * T).sum()) for k in range(K))
    assert ttt_pairs(docs, B, T, K) == dense


@pytest.mark.parametrize("packed", [False, True])
def test_dflash_pairs_equal_the_dense_block_mask_over_valid_blocks(packed):
    B, T, Bk, A = 2, 30, 4, 9
    docs = documents(B, T) if packed else None
    loss_mask = torch.ones(B, T, dtype=torch.long)
    loss_mask[1, 6:] = 0  # 5 valid anchors in row 1: padding anchors
    anchors, valid = sample_anchors(loss_mask, A, torch.Generator().manual_seed(0), docs)
    assert not valid.all()
    t = torch.arange(T)
    allow = t[None, None, :] < anchors[..., None]  # as DFlashDraftModel.forward builds it
    if docs is not None:
        allow = allow & (docs[:, None, :] == docs.gather(1, anchors)[..., None])
    mask = block_attention_mask(allow, valid, Bk).allow[:, 0]  # (B, A*Bk, T + A*Bk)
    queries = valid.repeat_interleave(Bk, dim=1)  # the queries of valid blocks
    assert dflash_pairs(anchors, valid, docs, Bk) == int(mask[queries].sum())


@pytest.mark.parametrize("packed", [False, True])
def test_cod_pairs_equal_the_dense_cod_mask_over_valid_elements(packed):
    B, T = 2, 40
    docs = documents(B, T) if packed else None
    loss_mask = torch.ones(B, T, dtype=torch.long)
    loss_mask[:, :5] = 0
    pred = step0_prediction_mask(loss_mask, docs)
    el = cod_sample(pred, 5, 0.8, 0.2, torch.Generator().manual_seed(1), None, docs)
    assert not el.valid.all() and (el.depth == 4).any()
    dense = cod_attention_mask(el, docs)  # (B, S, S)
    assert cod_allowed_pairs(el, docs) == int(dense[el.valid].sum())


@pytest.mark.parametrize("name, peak", [("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0),
                                        ("NVIDIA H100 NVL", 835.0), ("NVIDIA H200", 989.0),
                                        ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA GeForce RTX 4090", None)])
def test_device_peak_comes_from_the_device_name_unless_given(name, peak, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert device_peak_tflops(torch.device("cuda"), None)[0] == peak
    assert device_peak_tflops(torch.device("cuda"), 500.0) == (500.0, "--peak-tflops")
    assert device_peak_tflops(torch.device("cpu"), None)[0] is None


def test_flex_on_a_cpu_and_cuda_without_a_gpu_are_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--tiny", "--device", "cpu", "--backends", "flex"])
    assert exc.value.code == 2 and "flex_attention backward" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["--tiny"]) == 2
        assert "no CUDA device" in capsys.readouterr().err


def test_a_recipe_of_another_method_is_a_failed_row_not_a_crash(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["--recipes", "smollm2_135m_medusa", "--device", "cpu", "--no-capture", "--out", str(out)]) == 1
    (row,) = json.loads(out.read_text())["rows"]
    assert "draft.method 'medusa'" in row["error"]
    assert "error: ValueError" in capsys.readouterr().out


def test_default_recipes_are_the_llama_and_gpt_oss_recipes_of_the_three_methods():
    assert {load_recipe(RECIPES / f"{n}.yaml").draft.method for n in bench_gpu.DEFAULT_RECIPES} == set(bench_gpu.METHODS)
    for name in bench_gpu.DEFAULT_RECIPES:
        r = load_recipe(RECIPES / f"{name}.yaml")
        assert (r.train.batch_size, r.data.max_length) in ((4, 2048), (2, 4096)), name


def test_default_lengths_time_a_packed_batch_and_report_useful_tokens(tmp_path, one_thread):
    """--lengths default (the documented length distribution) with train.packing: the batch timed
    is the trainer's packed rows; useful tokens are its real positions, credited FLOPs count only them."""
    from benchmarks.lengths import default_lengths, trainer_rows

    out = tmp_path / "bench.json"
    argv = ["--tiny", "--device", "cpu", "--steps", "1", "--warmup", "0", "--no-capture", "--no-fake",
            "--no-flop-count", "--recipes", "smollm2_135m", "--batch-size", "2", "--max-length", "256",
            "--set", "train.packing=true", "--out", str(out)]
    assert main(argv) == 0
    (row,) = json.loads(out.read_text())["rows"]
    rows = trainer_rows(default_lengths(256), 2, 256, True, None, load_recipe(RECIPES / "smollm2_135m.yaml").seed)
    useful = sum(map(sum, rows))
    assert (row["useful_tokens"], row["documents"]) == (useful, sum(map(len, rows)))
    assert row["positions"] == 2 * row["max_length"] == 2 * max(map(sum, rows))  # sdpa: padded to the longest
    assert row["documents"] > 2 and row["lengths"] == "default" and row["packing"]
    assert row["useful_tokens_per_s"] == pytest.approx(row["positions_per_s"] * useful / row["positions"])
    # attention credited inside the documents only: K causal blocks per document plus the diagonals
    K = load_recipe(RECIPES / "smollm2_135m.yaml").draft.ttt_steps
    want = sum(K * L * (L + 1) // 2 for r in rows for L in r) + useful * K * (K - 1) // 2
    assert row["flops"]["attention_pairs"] == want


def test_default_length_distribution_is_the_documented_one():
    from benchmarks.lengths import default_lengths

    x = torch.tensor(default_lengths(4096, n=20000), dtype=torch.float64)
    assert x.min() >= 32 and x.max() == 4096
    assert 0.95 * 1024 < x.median() < 1.05 * 1024  # median 0.25 * max_length
    assert 0.02 < (x == 4096).double().mean() < 0.06  # log-normal sigma 0.8: about 4% truncated
    assert default_lengths(4096, n=50, seed=3) == default_lengths(4096, n=50, seed=3)
