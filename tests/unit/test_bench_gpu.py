"""``benchmarks/gpu.py`` (``make bench-gpu``) on the CPU: the whole path end to end at a tiny
geometry (the SmolLM2-135M recipes of EAGLE-3, DFlash, P-EAGLE and DSpark at 1 x 64, so it does not
first fail on a booked GPU), the credited FLOPs against torch's FLOP counter, the attention pair
counts against the dense masks of the three drafts, the device peak table and bad input; and the
evidence that the GPU step's fast paths ran (tests/helpers/fast_path.py, the rows' ``fused_loss_ran``
and ``compiled_regions``), proved here as far as a CPU can: the fused loss's op through Triton's
interpreter (``TRITON_INTERPRET=1``, a subprocess: :func:`_worker`, as tests/unit/test_fused_loss.py
runs it) and the compiled regions under dynamo's eager backend."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

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

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "recipes"


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
        assert r["loss_tokens"] == r["useful_tokens"] == 64 and r["loss_tokens_per_s"] == r["useful_tokens_per_s"]
        # a CPU step takes the chunked loss (train.fused_loss auto: CUDA only) and compiles nothing (train.compile auto)
        assert (r["fused_loss"], r["fused_loss_ran"], r["fused_loss_launches_per_step"]) == ("auto", False, 0)
        assert (r["compiled_regions"], r["compile_regions"], r["compiled_graphs"]) == (0, 0, 0)
        assert r["first_step_s"] is None and r["compile_s"] is None  # --warmup 0: no cold step timed alone
        assert set(r["compile_caches"]) == {"inductor", "triton"}
        assert "| no (auto) | 0/0 | - |" in table
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
    assert row["loss_tokens"] == useful and row["loss_tokens_per_s"] == pytest.approx(row["useful_tokens_per_s"])
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


# --------------------------------------------------------------------------------------
# evidence that the fast paths ran (tests/helpers/fast_path.py, the rows' fused_loss_ran / compiled_regions)

M_ROWS, H_DIM, V_DIM, N_TEACHER, CHUNK = 10, 16, 70, 5, 4  # 3 chunks of rows (4, 4, 2)


def _distill(fused: bool | str, device_ok: bool) -> dict[str, Any]:
    """One chunked_distill of a draft head marked ``fused_as`` (as the drafts' ``compute_logits``)
    under :func:`helpers.fast_path.fast_path`, ``train.fused_loss`` = ``fused``; ``device_ok``:
    the fused loss may run on this CPU (``losses.fused_device_ok``, as ``bench memory``'s fake GPU
    step says; the kernel then runs under Triton's interpreter)."""
    from draftsmith.train import losses
    from draftsmith.train.losses import LossSpec, chunked_distill
    from helpers.fast_path import fast_path

    g = torch.Generator().manual_seed(0)
    norm, head = torch.nn.RMSNorm(H_DIM), torch.nn.Linear(H_DIM, V_DIM, bias=False)
    with torch.no_grad():  # the same draft in every call
        norm.weight.copy_(1 + 0.1 * torch.randn(H_DIM, generator=g))
        head.weight.copy_(0.5 * torch.randn(V_DIM, H_DIM, generator=g))

    class Draft(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.lm_head = norm, head

        def compute_logits(self, h):
            return self.lm_head(self.norm(h))

        compute_logits.fused_as = ("norm", "lm_head")

    h = torch.randn(M_ROWS, H_DIM, generator=g, requires_grad=True)
    teacher, index = torch.randn(N_TEACHER, V_DIM, generator=g) * 3, torch.randint(0, N_TEACHER, (M_ROWS,), generator=g)
    weight = torch.rand(M_ROWS, generator=g)
    saved = losses.fused_device_ok
    if device_ok:
        losses.fused_device_ok = lambda device: True
    try:
        with fast_path() as seen:
            out = chunked_distill(h, Draft().compute_logits, teacher, index, weight, LossSpec("jsd"), chunk_size=CHUNK,
                                  fused=fused)
            grad = torch.autograd.grad(out.loss_sum, [h, head.weight])
    finally:
        losses.fused_device_ok = saved
    return {"dispatched": seen.dispatched, "launched": seen.launched, "fallbacks": seen.fallbacks,
            "loss": out.loss_sum.detach(), "grad_h": grad[0], "grad_w": grad[1]}


def _bench_row(out: str) -> dict[str, Any]:
    """benchmarks.gpu's tiny EAGLE-3 row on this CPU with the GPU's fast paths forced: the fused loss
    (``losses.fused_device_ok``; the kernel under Triton's interpreter) and ``train.compile`` (dynamo's
    eager backend, :func:`helpers.fast_path.eager_compile`)."""
    from draftsmith.train import losses
    from helpers.fast_path import eager_compile

    saved = losses.fused_device_ok
    losses.fused_device_ok = lambda device: True
    try:
        with eager_compile():
            code = main(["--tiny", "--device", "cpu", "--steps", "1", "--warmup", "1", "--no-capture", "--no-fake",
                         "--no-flop-count", "--recipes", "smollm2_135m", "--max-length", "16", "--lengths", "full",
                         "--set", "train.compile=true", "--out", out])
    finally:
        losses.fused_device_ok = saved
    assert code == 0
    (row,) = json.loads(Path(out).read_text())["rows"]
    return row


def _worker(path: str) -> None:
    from draftsmith.train import fused_loss

    assert fused_loss.interpreted(), "run with TRITON_INTERPRET=1"
    torch.set_num_threads(1)
    torch.save({"chunked": _distill(False, False), "fused": _distill(True, True),
                "fallback": [_distill(True, False), _distill(True, False)],
                "bench": _bench_row(path + ".json")}, path)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict[str, Any]:
    """:func:`_worker`'s results, run once in a subprocess started with ``TRITON_INTERPRET=1`` (the
    interpreter must be on before triton is first imported, which pytest has done already)."""
    from draftsmith.train import fused_loss

    if fused_loss.triton is None:
        pytest.skip("triton is not importable")
    path = tmp_path_factory.mktemp("fast_path") / "results.pt"
    paths = os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": paths, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, __file__, str(path)], capture_output=True, text=True, timeout=900,
                          check=False, env=env)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return torch.load(path)


def test_the_dispatch_counter_sees_no_fused_op_on_the_chunked_path(interpreted):
    r = interpreted["chunked"]
    assert (r["dispatched"], r["launched"], r["fallbacks"]) == (0, 0, [])  # train.fused_loss false: no warning


def test_the_dispatch_counter_sees_the_fused_op_once_per_chunk_when_forced(interpreted):
    from helpers.fast_path import FastPath

    r, want = interpreted["fused"], interpreted["chunked"]
    assert (r["dispatched"], r["launched"], r["fallbacks"]) == (3, 3, [])  # 10 rows in chunks of 4
    FastPath(r["dispatched"], r["launched"], r["fallbacks"]).assert_fused(dispatches=3)
    # the same values as the chunked torch path: the op ran, and ran right
    torch.testing.assert_close(r["loss"], want["loss"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(r["grad_h"], want["grad_h"], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(r["grad_w"], want["grad_w"], rtol=1e-4, atol=1e-5)


def test_a_fallback_to_the_chunked_loss_is_seen_every_time_and_fails_the_check(interpreted):
    """train.fused_loss true where the fused loss cannot run (a CPU): losses warns once per reason
    per process; fast_path empties that memory, so the second call's fallback is seen too."""
    from helpers.fast_path import FastPath

    for r in interpreted["fallback"]:
        assert (r["dispatched"], r["launched"]) == (0, 0)
        assert len(r["fallbacks"]) == 1 and "CUDA" in r["fallbacks"][0] and "chunked loss" in r["fallbacks"][0]
        seen = FastPath(r["dispatched"], r["launched"], r["fallbacks"])
        with pytest.raises(AssertionError, match="fell back"):
            seen.assert_fused()
        with pytest.raises(AssertionError, match="never launched"):
            FastPath(r["dispatched"], r["launched"], []).assert_fused()


def test_a_bench_row_records_the_fused_loss_and_the_compiled_regions_it_ran(interpreted):
    row = interpreted["bench"]
    assert row["error"] is None and row["method"] == "eagle3"
    # the fused op in the timed step: per TTT step one call of chunks of rows (3 TTT steps, 16 rows each)
    assert row["fused_loss_ran"] and row["fused_loss_launches_per_step"] >= 3
    assert row["compiled_regions"] == row["compile_regions"] == 4  # the layer's 4 regions, each compiled
    assert row["compiled_graphs"] >= 4 and row["graphs_after_first_step"] == 0  # one compile, then none
    assert row["first_step_s"] > 0 and 0 <= row["compile_s"] <= row["first_step_s"]
    assert row["loss_tokens"] == row["useful_tokens"] == 16 and row["loss_tokens_per_s"] > 0
    for cache in row["compile_caches"].values():
        assert cache["dir"] and isinstance(cache["default"], bool) and isinstance(cache["had_entries"], bool)


def test_time_steps_times_the_first_warmup_step_alone_and_probes_only_the_timed_steps():
    calls, inside = [], []

    class Probe:
        def __enter__(self):
            inside.append(len(calls))

        def __exit__(self, *exc):
            inside.append(len(calls))

    seconds, mem = bench_gpu.time_steps(calls.append, 3, 2, torch.device("cpu"), first=5, timed=Probe())
    assert calls == [5, 6, 7, 8, 9] and inside == [2, 5]  # the probe saw steps 7, 8, 9 only
    assert seconds >= 0 and mem["first_step_s"] >= 0
    assert bench_gpu.time_steps(calls.append, 1, 0, torch.device("cpu"))[1]["first_step_s"] is None


def test_the_op_counter_leaves_compiled_regions_compiled():
    """A dispatch mode makes dynamo skip every frame unless it ignores compile internals: under
    fast_path's counter the tiny EAGLE-3 layer's regions are still traced and hold compiled code
    (dynamo's eager backend here; inductor on a GPU), and compiled_regions sees them."""
    from draftsmith.models.common import compile_regions
    from draftsmith.models.eagle3.model import Eagle3DraftModel
    from helpers.fast_path import dynamo_frames, eager_compile, fast_path
    from helpers.tiny import eagle3_tiny_config

    torch._dynamo.reset()
    cfg = eagle3_tiny_config()
    model = Eagle3DraftModel(cfg)
    assert bench_gpu.compiled_regions(model) == (0, 0)
    with eager_compile():
        assert compile_regions(model) == 1
    assert bench_gpu.compiled_regions(model) == (4, 0)  # wrapped, not yet compiled
    ids, aux = torch.randint(0, cfg.vocab_size, (1, 8)), torch.randn(1, 8, 3 * cfg.target_hidden_size)
    try:
        with dynamo_frames() as frames, fast_path() as seen:
            model(ids, aux, 2)
        assert bench_gpu.compiled_regions(model) == (4, 4)
    finally:
        torch._dynamo.reset()
    assert frames.frames >= 4 and frames.graphs >= 4
    seen.assert_chunked()  # no loss in a bare forward


if __name__ == "__main__":  # the interpreter subprocess of the fixture `interpreted`
    _worker(sys.argv[1])
