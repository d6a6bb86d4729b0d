"""Proof on a GPU (docs/gpu_checks.md): the draft methods, hidden-state capture and the accelerate launchers on
CUDA, each checked against a CPU run, an fp32 run or an uninterrupted run of its own; the
flex-attention backend against SDPA for the three attention-heavy drafts; and the training memory
of each GPU recipe's real step against ``draftsmith bench memory``'s fake-tensor measurement.

    pytest -m gpu tests/gpu/test_gpu.py        # on a machine with a CUDA GPU (one is enough)

Every CUDA test is marked ``gpu`` and skipped when ``torch.cuda.is_available()`` is False, so CI
collects and skips them. Training runs go through the real entry points in subprocesses
(``accelerate launch --config_file ... -m draftsmith.train RECIPE --run-dir RUN``): accelerate keeps
one process-wide state, so an fp32 CPU run and a bf16 CUDA run cannot share a process, and the
launchers are what is being proven. The data (tiny random target of ``conftest.py``, fp32
shards) is prepared once and copied into every run directory.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch
import yaml
from safetensors.torch import load_file

from draftsmith.target.capture import TransformersCapture
from draftsmith.data_prep.prepare import prepare
from draftsmith.target import load_target
from benchmarks import gpu as bench_gpu
from draftsmith.models.eagle3.format import expected_weight_shapes
from draftsmith.train.checkpoint import read_draft
from draftsmith.models.dflash.model import block_attention, block_attention_mask
from draftsmith.models.eagle3.model import Eagle3DraftModel, TTTMask, ttt_attention
from draftsmith.models.peagle.model import CODMask
from draftsmith.models.dflash.training import sample_anchors
from draftsmith.models.peagle.training import cod_sample, step0_prediction_mask
from draftsmith.models.dflash.recipe import DFlashDraftConfig
from draftsmith.models.peagle.recipe import PEagleDraftConfig
from draftsmith.recipe import Recipe, dump_recipe
from draftsmith.train.checkpoint import find_checkpoints

from helpers.tiny import TINY_AUX, write_jsonl
from helpers.faults import max_param_diff, read_metrics, wait_for_step
from helpers.recipes import medusa_recipe
from helpers.recipes import mlp_recipe
from helpers.recipes import PROMPTS, tiny_recipe

REPO = Path(__file__).resolve().parents[2]
CUDA = torch.cuda.is_available()
DEVICE = "cuda"  # where the capture test puts the target (the training runs: the launcher decides)

# bf16 keeps 8 significant bits: one rounding is off by at most 2**-8 (its unit roundoff).
BF16_UNIT_ROUNDOFF = 2.0**-8

# Per-step training loss, bf16 autocast on CUDA vs fp32 on CPU, same data and initial weights:
# relative difference <= one bf16 unit roundoff. Each loss is a mean over hundreds of tokens of
# fp32 log-softmaxes of logits computed from bf16-rounded inputs, so the roundings average out far
# below one unit roundoff; AdamW then carries the small weight differences into later steps.
# Calibrated with the trainer under bf16 autocast on CPU: at most 6.5e-4 over these 6 steps for
# all three methods, whereas a run whose draft starts from another seed differs by up to 9.7%
# (eagle3, step 1) and 0.8% (mlp_speculator, step 6); Medusa's start does not depend on the seed.
LOSS_RTOL = BF16_UNIT_ROUNDOFF
# DFlash and P-EAGLE draw their anchors / COD elements from a generator on the batch's device: a
# CUDA generator draws other numbers than a CPU one, so their reference is an fp32 run on the same
# GPU (same draws; TF32 matmuls, as the trainer sets on CUDA). Calibrated like LOSS_RTOL (the
# trainer under bf16 autocast on CPU against fp32 on CPU, same draws, these 6 steps): at most
# 4.3e-3 (dflash) and 2.9e-3 (peagle), whereas a run from another seed differs by up to 6.6%
# (dflash) and 30% (peagle); so two bf16 unit roundoffs. On an H100 (torch 2.11, CUDA 13.0,
# 2026-11-25) P-EAGLE went past that once: 8.5e-4, 1.6e-3, then 1.23e-2 at step 3, and back to
# 2.7e-3 / 8.5e-4 / 1.3e-3 (CUDA's bf16 attention kernels round differently from CPU autocast, and
# a step of P-EAGLE's COD loss over few tokens moves with them); DFlash stayed within 2. P-EAGLE's
# bound is therefore four roundoffs (1.6e-2), still 20x below a run from another seed.
DRAW_LOSS_RTOL = {"dflash": 2 * BF16_UNIT_ROUNDOFF, "peagle": 4 * BF16_UNIT_ROUNDOFF}
# Step 1 starts from identical weights: an fp32 CUDA run differs from the CPU run by reduction
# order only (~1e-7). Below FP32_NOISE bf16 autocast was not in effect; in the calibration bf16
# moved the step-1 loss by 2e-5 (mlp_speculator) to 2.6e-4 (eagle3).
FP32_NOISE = 1e-6
STEPS, LR = 6, 3e-3

# Hidden-state capture, max over tokens of |x_cuda - x_cpu| / |x_cpu| per state (each aux layer,
# the final state). fp32 on both devices (TF32 off, torch's default): reduction order only. bf16 on
# CUDA vs fp32 on CPU: the stored state's own rounding plus what 6 layers of bf16 matmuls add;
# measured 0.66% (aux) / 0.87% (final) with the target in bf16 on CPU, so 6 unit roundoffs (2.3%).
# The tiny target's residual stream is dominated by its (scaled-up) embedding: neighbouring layers
# differ by only 0.7-0.9%, so the fp32 comparison is the one that would notice a wrong layer.
CAPTURE_TOL = {torch.float32: 1e-4, torch.bfloat16: 6 * BF16_UNIT_ROUNDOFF}

# Launchers: batch 2 x accumulation 2 over the 8 tiny sequences (2 optimizer steps per epoch, so
# resumes land mid-epoch), a checkpoint every 3 steps; the killed run is stopped with SIGKILL once
# step KILL_AFTER is logged, far from the end (a tiny step takes milliseconds on a GPU).
LAUNCH_TRAIN = {"max_steps": 40, "batch_size": 2, "grad_accum_steps": 2, "checkpoint_every": 3,
                "keep_checkpoints": 2, "log_every": 1, "warmup_ratio": 0.1}
KILL_AFTER = 8
# Resume on the same GPU with the same kernels is expected to be bitwise exact (as on CPU,
# tests/integration/test_resume.py); the slack only absorbs a non-reproducible kernel.
RESUME_TOL = 1e-6
# accelerate's distributed type each launcher must produce (recorded in train_state.json)
DISTRIBUTED_TYPE = {"single_gpu": "NO", "deepspeed_zero2": "DEEPSPEED", "fsdp2": "FSDP"}
TIMEOUT_S = 600

# flex-attention against SDPA (same inputs, rounded to the dtype), each against SDPA in float64 on
# those inputs: the worst output row's relative error, and the gradients' norm-relative error.
# fp32: TF32's unit roundoff (2**-11) with a factor 2 of slack, in case a kernel takes TF32
# (fp32 kernels land near 1e-6); bf16: the softmax weights and the output are rounded to bf16
# (unit roundoff 2**-8), and a row's error stays within a few of them. A wrong mask entry moves a
# row by O(1). A backend may also be up to twice as far off as SDPA in the same dtype.
FLEX_TOL = {torch.float32: 2.0**-10, torch.bfloat16: 2.0**-5}
# the real training step of each GPU recipe: its CUDA peak against bench memory's fake measurement
MEMORY_RTOL = 0.25
DEVICE_MEMORY_SHARE = 0.9


def gpu_test(fn):
    """Mark ``fn`` ``gpu`` and skip it without CUDA."""
    skip = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU: torch.cuda.is_available() is False")
    return pytest.mark.gpu(skip(fn))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment without launcher settings it may carry (``ACCELERATE_*``),
    with reproducible cuBLAS workspaces (CUBLAS_WORKSPACE_CONFIG)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
    env.update(CUBLAS_WORKSPACE_CONFIG=":4096:8", PYTHONUNBUFFERED="1", **extra)
    return env


def train_cmd(recipe: Path, run: Path, *extra: str) -> list[str]:
    """``-m draftsmith.train RECIPE --run-dir RUN --no-prepare ...``, the method the recipe's (the data is
    the fixture's: a run must not prepare its own)."""
    return ["-m", "draftsmith.train", str(recipe), "--run-dir", str(run), "--no-prepare", *extra]


def accelerate_cmd(config: Path, recipe: Path, run: Path, *extra: str) -> list[str]:
    """``accelerate launch --config_file CONFIG -m draftsmith.train RECIPE --run-dir RUN ...``."""
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
            "--main_process_port", str(free_port()), *train_cmd(recipe, run, *extra)]


class Jobs:
    """Subprocesses with their output in log files; on exit every one still running is killed
    with its whole process tree (torchrun starts its workers in sessions of their own)."""

    def __init__(self, logs: Path):
        self.logs, self.procs = logs, {}
        logs.mkdir(parents=True, exist_ok=True)

    def __enter__(self) -> "Jobs":
        return self

    def __exit__(self, *exc) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                kill_tree(proc)

    def start(self, name: str, cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
        with (self.logs / f"{name}.log").open("w") as fh:
            self.procs[name] = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        return self.procs[name]

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    def finish(self, name: str) -> str:
        """Wait for job ``name``; returns its log, fails the test (log tail shown) unless it exited 0."""
        proc = self.procs[name]
        try:
            rc = proc.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            kill_tree(proc)
            pytest.fail(f"{name} ran past {TIMEOUT_S}s:\n{self.log(name)[-4000:]}")
        if rc != 0:
            pytest.fail(f"{name} exited {rc}: {' '.join(proc.args)}\n{self.log(name)[-4000:]}")
        return self.log(name)


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc`` and all its descendants at once (a crash of the whole job)."""
    try:
        procs = psutil.Process(proc.pid).children(recursive=True) + [psutil.Process(proc.pid)]
    except psutil.NoSuchProcess:
        procs = []
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=60)
    proc.wait(timeout=60)


def new_run(data: Path, run: Path) -> Path:
    shutil.copytree(data, run / "data")
    return run


def ckpt_step(ckpt: Path) -> int:
    return json.loads((ckpt / "train_state.json").read_text())["step"]


def strip_module(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k.removeprefix("module."): v for k, v in state.items()}


@pytest.fixture(scope="module")
def prepared(tiny_target, tmp_path_factory) -> tuple[Path, Path]:
    """``(prompts, RUN/data)`` of the tiny target, prepared once with fp32 shards (so that the CPU
    reference trains in fp32 throughout)."""
    root = tmp_path_factory.mktemp("gpu_data")
    prompts = write_jsonl(root / "prompts.jsonl", [{"id": f"p{i}", "prompt": p} for i, p in enumerate(PROMPTS)])
    prepare(method_recipe(tiny_target, prompts, "eagle3"), root)
    return prompts, root / "data"


def method_recipe(tiny_target: Path, prompts: Path, method: str) -> Recipe:
    """The test suite's tiny recipe of ``method`` (same data section for all), STEPS steps of one
    fixed batch (all 8 sequences), fp32 shards."""
    build = {"eagle3": tiny_recipe, "medusa": medusa_recipe, "mlp_speculator": mlp_recipe,
             "dflash": tiny_recipe, "peagle": tiny_recipe}[method]
    recipe = build(tiny_target, prompts)
    if method == "dflash":  # the draft test_host_sync.py trains on the same data
        recipe.draft = DFlashDraftConfig(num_layers=1, block_size=4, num_anchors=16, freeze_lm_head=False)
    elif method == "peagle":
        recipe.draft = PEagleDraftConfig(num_layers=1, num_depths=3)
    recipe.data.hidden_states_dtype = "float32"
    recipe.train.max_steps, recipe.train.lr = STEPS, LR
    return recipe


def launcher_config(name: str, recipe: Recipe, directory: Path) -> Path:
    """The launcher YAML of ``name`` with one process: ``recipes/accelerate/single_gpu.yaml`` as
    is (``single_gpu_fp32``: with ``mixed_precision: no``); the 8-GPU DeepSpeed ZeRO-2 and FSDP2
    files with ``num_processes: 1``. DeepSpeed gets a
    ``deepspeed_config_file`` whose micro-batch, accumulation and clipping are the recipe's
    numbers (not "auto"); accelerate then takes the precision from the JSON and refuses
    ``mixed_precision`` in the YAML."""
    if name == "single_gpu":
        return REPO / "recipes" / "accelerate" / "single_gpu.yaml"
    if name == "single_gpu_fp32":  # the same GPU without mixed precision: fp32 (TF32 matmuls)
        cfg = yaml.safe_load((REPO / "recipes" / "accelerate" / "single_gpu.yaml").read_text())
        cfg["mixed_precision"] = "no"
        path = directory / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        return path
    source = {"deepspeed_zero2": "deepspeed_zero2_8gpu.yaml", "fsdp2": "fsdp_8gpu.yaml"}[name]
    cfg = yaml.safe_load((REPO / "recipes" / "accelerate" / source).read_text())
    cfg["num_processes"] = 1
    if name == "deepspeed_zero2":
        ds = directory / "deepspeed_zero2.json"
        ds.write_text(json.dumps({
            "train_micro_batch_size_per_gpu": recipe.train.batch_size,
            "gradient_accumulation_steps": recipe.train.grad_accum_steps,
            "gradient_clipping": recipe.train.max_grad_norm,
            "zero_optimization": {"stage": 2},
            "bf16": {"enabled": True},
        }, indent=1))
        cfg["deepspeed_config"] = {"deepspeed_config_file": str(ds), "zero3_init_flag": False}
        cfg.pop("mixed_precision", None)
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def launcher_recipe(tiny_target: Path, prompts: Path) -> Recipe:
    recipe = method_recipe(tiny_target, prompts, "eagle3")
    for key, value in LAUNCH_TRAIN.items():
        setattr(recipe.train, key, value)
    return recipe


def skip_without_deepspeed() -> None:
    probe = subprocess.run([sys.executable, "-c", "import deepspeed"], capture_output=True, text=True,
                           env=child_env(), timeout=300)
    if probe.returncode != 0:
        pytest.skip(f"DeepSpeed not importable ({probe.stderr.strip().splitlines()[-1:]}); bring its sdist + hjson "
                    "(pip install --no-build-isolation --no-deps)")


def relative_errors(got: list[float], want: list[float]) -> list[float]:
    return [abs(g - w) / abs(w) for g, w in zip(got, want)]


def row_relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max over rows of ``|got - want| / |want|`` for ``(T, D)`` states (computed in fp32)."""
    got, want = got.float(), want.float()
    return float(((got - want).norm(dim=-1) / want.norm(dim=-1)).max())


@gpu_test
@pytest.mark.parametrize("method", ["eagle3", "medusa", "mlp_speculator"])
def test_bf16_training_on_cuda_tracks_fp32_training_on_cpu(method, tiny_target, prepared, tmp_path):
    prompts, data = prepared
    recipe = tmp_path / "recipe.yaml"
    dump_recipe(method_recipe(tiny_target, prompts, method), recipe)
    cuda, cpu = new_run(data, tmp_path / "cuda"), new_run(data, tmp_path / "cpu")
    with Jobs(tmp_path / "logs") as jobs:  # both at once: one uses the GPU, the other the CPU cores
        jobs.start("cuda", accelerate_cmd(REPO / "recipes" / "accelerate" / "single_gpu.yaml", recipe, cuda),
                   child_env())
        jobs.start("cpu", [sys.executable, *train_cmd(recipe, cpu)],
                   child_env(ACCELERATE_USE_CPU="1", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="4"))
        jobs.finish("cuda")
        jobs.finish("cpu")
    got, want = ([m["loss"] for m in read_metrics(run)] for run in (cuda, cpu))
    assert len(got) == len(want) == STEPS
    errors = relative_errors(got, want)
    assert max(errors) <= LOSS_RTOL, f"{method}: CUDA bf16 losses {got} vs CPU fp32 {want} (relative {errors})"
    assert errors[0] > FP32_NOISE, f"{method}: the CUDA run reproduced fp32 ({errors}): bf16 autocast was not on"


@gpu_test
@pytest.mark.parametrize("method", ["dflash", "peagle"])
def test_bf16_training_on_cuda_tracks_fp32_training_on_cuda(method, tiny_target, prepared, tmp_path):
    """DFlash and P-EAGLE draw anchors / COD elements from a CUDA generator, which a CPU run cannot
    reproduce: their bf16 run is held against an fp32 run on the same GPU (same draws)."""
    prompts, data = prepared
    recipe = method_recipe(tiny_target, prompts, method)
    recipe_path = tmp_path / "recipe.yaml"
    dump_recipe(recipe, recipe_path)
    fp32_launcher = launcher_config("single_gpu_fp32", recipe, tmp_path)
    bf16, fp32 = new_run(data, tmp_path / "bf16"), new_run(data, tmp_path / "fp32")
    with Jobs(tmp_path / "logs") as jobs:  # both at once: two tiny drafts share the GPU
        jobs.start("bf16", accelerate_cmd(REPO / "recipes" / "accelerate" / "single_gpu.yaml", recipe_path,
                                          bf16), child_env())
        jobs.start("fp32", accelerate_cmd(fp32_launcher, recipe_path, fp32), child_env())
        jobs.finish("bf16")
        jobs.finish("fp32")
    got, want = ([m["loss"] for m in read_metrics(run)] for run in (bf16, fp32))
    assert len(got) == len(want) == STEPS
    errors = relative_errors(got, want)
    assert max(errors) <= DRAW_LOSS_RTOL[method], f"{method}: CUDA bf16 losses {got} vs CUDA fp32 {want} (relative {errors})"
    assert errors[0] > FP32_NOISE, f"{method}: the bf16 run reproduced fp32 ({errors}): bf16 autocast was not on"


# ---------------------------------------------------------------------------------------------
# flex-attention against SDPA on CUDA (the CPU tests check flex's forward only: torch has no flex
# backward on a CPU)


def cuda_generator(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


def leaf(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=g, device="cuda").to(dtype).requires_grad_()


def packed_documents(B: int, T: int) -> torch.Tensor:
    """``(B, T)`` three documents per row, of other lengths in every row (contiguous runs)."""
    docs = torch.zeros(B, T, dtype=torch.long, device="cuda")
    for b in range(B):
        docs[b, T // 3 + 7 * b:] = 1
        docs[b, 2 * T // 3 - 5 * b:] = 2
    return docs


def row_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max over rows (last dim) of ``|got - want| / |want|`` in float64; 0 where both are 0."""
    diff = (got.detach().double() - want.detach()).norm(dim=-1)
    return float((diff / want.norm(dim=-1).clamp_min(1e-30)).max())


def norm_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm().clamp_min(1e-30))


def assert_flex_matches_sdpa(run, leaves: list[torch.Tensor], dtype: torch.dtype, what: str) -> None:
    """``run(backend, leaves) -> output``: flex and SDPA in ``dtype`` against SDPA in float64 on the
    same (``dtype``-rounded) inputs, outputs row by row and every input's gradient (FLEX_TOL)."""
    reference = [t.detach().double().requires_grad_() for t in leaves]
    want = run("sdpa", reference)
    upstream = torch.randn(want.shape, generator=cuda_generator(99), device="cuda", dtype=torch.float64)
    want_grads = torch.autograd.grad(want, reference, upstream)
    errors = {}
    for backend in ("sdpa", "flex"):
        out = run(backend, leaves)
        assert out.dtype == dtype
        grads = torch.autograd.grad(out, leaves, upstream.to(dtype))
        errors[backend] = (row_error(out, want.detach()),
                           max(norm_error(g, w) for g, w in zip(grads, want_grads)))
    tol = FLEX_TOL[dtype]
    for i, part in enumerate(("output", "gradients")):
        flex, sdpa = errors["flex"][i], errors["sdpa"][i]
        assert sdpa <= 4 * tol, f"{what} {dtype} SDPA {part}: relative error {sdpa} against float64"
        assert flex <= max(tol, 2 * sdpa), f"{what} {dtype} flex {part}: relative error {flex} (SDPA {sdpa})"


DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
PACKED = pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])


@gpu_test
@DTYPES
@PACKED
def test_eagle3_flex_ttt_attention_equals_sdpa_on_cuda(dtype, packed, monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    torch._dynamo.reset()
    B, nh, nkv, T, hd, K = 2, 8, 2, 256, 64, 3  # the last of K steps: the causal block and K-1 diagonals
    g = cuda_generator(0)
    docs = packed_documents(B, T) if packed else None
    q = leaf((B, nh, T, hd), dtype, g)
    kv = [leaf((B, nkv, T, hd), dtype, g) for _ in range(2 * K)]
    masks = {b: TTTMask.build(T, K, torch.device("cuda"), docs, backend=b) for b in ("sdpa", "flex")}
    assert masks["flex"].block_masks is not None and masks["flex"].dense is None

    def run(backend, leaves):
        q, *rest = leaves
        return ttt_attention(q, rest[:K], rest[K:], hd ** -0.5, mask=masks[backend])

    assert_flex_matches_sdpa(run, [q, *kv], dtype, "EAGLE-3 TTT")


@gpu_test
@DTYPES
@PACKED
def test_dflash_flex_block_attention_equals_sdpa_on_cuda(dtype, packed, monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    torch._dynamo.reset()
    B, nh, nkv, T, hd, A, Bk = 2, 8, 2, 256, 64, 24, 8  # A * Bk = 192 queries: not a multiple of the tile
    g = cuda_generator(1)
    docs = packed_documents(B, T) if packed else None
    loss_mask = torch.ones(B, T, dtype=torch.long, device="cuda")
    loss_mask[1, 16:] = 0  # row 1 has fewer valid anchors than A: padding blocks (output 0)
    anchors, valid = sample_anchors(loss_mask, A, cuda_generator(2), docs)
    assert not bool(valid.all())
    t = torch.arange(T, device="cuda")
    allow = t[None, None, :] < anchors[..., None]  # as DFlashDraftModel.forward builds it
    if docs is not None:
        allow = allow & (docs[:, None, :] == docs.gather(1, anchors)[..., None])
    masks = {b: block_attention_mask(allow, valid, Bk, backend=b) for b in ("sdpa", "flex")}
    assert masks["flex"].flex is not None and masks["flex"].allow is None
    leaves = [leaf((B, nh, A * Bk, hd), dtype, g), leaf((B, nkv, T, hd), dtype, g), leaf((B, nkv, T, hd), dtype, g),
              leaf((B, nkv, A * Bk, hd), dtype, g), leaf((B, nkv, A * Bk, hd), dtype, g)]

    def run(backend, x):
        return block_attention(*x, masks[backend], hd ** -0.5)

    assert_flex_matches_sdpa(run, leaves, dtype, "DFlash blocks")


@gpu_test
@DTYPES
@PACKED
def test_peagle_flex_cod_attention_equals_sdpa_on_cuda(dtype, packed, monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    torch._dynamo.reset()
    B, nh, nkv, T, hd, D = 2, 8, 2, 192, 64, 4
    g = cuda_generator(3)
    docs = packed_documents(B, T) if packed else None
    loss_mask = torch.ones(B, T, dtype=torch.long, device="cuda")
    loss_mask[:, :10] = 0
    elements = cod_sample(step0_prediction_mask(loss_mask, docs), D, 0.8, 0.2, cuda_generator(4), None, docs)
    S = elements.anchor.shape[1]
    assert S > T and not bool(elements.valid.all())  # deep chains and empty slots
    masks = {b: CODMask(elements, docs, backend=b) for b in ("sdpa", "flex")}
    leaves = [leaf((B, nh, S, hd), dtype, g), leaf((B, nkv, S, hd), dtype, g), leaf((B, nkv, S, hd), dtype, g)]

    def run(backend, x):
        return masks[backend].attend(*x)

    assert_flex_matches_sdpa(run, leaves, dtype, "P-EAGLE COD")


# ---------------------------------------------------------------------------------------------
# the GPU recipes' real step: memory


@gpu_test
@pytest.mark.parametrize("backend", ["sdpa", "flex"])
@pytest.mark.parametrize("name", bench_gpu.DEFAULT_RECIPES)
def test_recipe_step_fits_the_gpu_and_matches_bench_memory(name, backend):
    """The recipe's real training step (its method, B x T and launcher precision, random weights
    at the target's geometry; ``benchmarks/gpu.py``'s step: compute_loss, backward, clipping, the
    fused AdamW) on this GPU: ``torch.cuda.max_memory_allocated`` over the second step (with the
    optimizer state) is below 90% of the device and within 25% of ``draftsmith bench memory``'s
    fake-tensor measurement of the same step in one process (its SDPA step: flex is only held
    to the upper bound). The fake step runs the CPU's SDPA path, which takes grouped key/value
    heads without expanding them; CUDA expands them (``repeat_kv``), a few GiB at most here."""
    from benchmarks.memory import Precision, measure_step

    args = argparse.Namespace(target_config=None, batch_size=None, max_length=None)
    recipe, config_json, _, launch = bench_gpu.load_bench_recipe(name, [], args)
    precision = Precision.of(launch)
    sdpa = recipe.model_copy(deep=True)
    sdpa.train.attention_backend = "sdpa"
    fake = measure_step(sdpa, config_json, launch, precision, device="fake").process_peak_bytes
    r = recipe.model_copy(deep=True)
    r.train.attention_backend = backend
    gc.collect()
    torch.cuda.empty_cache()
    m = bench_gpu.bench_training(r, config_json, precision, torch.device("cuda"), steps=1, warmup=1,
                                 count_executed=False)
    gc.collect()
    torch.cuda.empty_cache()
    peak = m["memory"]["max_allocated"]
    device = torch.cuda.get_device_properties(0).total_memory
    what = f"{name} ({backend}, {precision.name}): CUDA peak {peak / 2**30:.2f} GiB, fake {fake / 2**30:.2f} GiB"
    assert peak < DEVICE_MEMORY_SHARE * device, f"{what}, device {device / 2**30:.1f} GiB"
    assert peak <= (1 + MEMORY_RTOL) * fake, what
    if backend == "sdpa":
        assert peak >= (1 - MEMORY_RTOL) * fake, what
    assert m["metrics"]["loss"] > 0 and m["flops"]["total"] > 0


@gpu_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_capture_on_cuda_equals_capture_on_cpu(dtype, tiny_target):
    model, _ = load_target(tiny_target, torch.float32)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    # mixed lengths: several right-padded batches of at most 128 tokens
    records = [{"input_ids": torch.randint(0, vocab, (n,), generator=g).tolist()} for n in (5, 17, 33, 40, 64, 96)]

    def capture(device: str, dt: torch.dtype) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        engine = TransformersCapture(model.to(device, dt), TINY_AUX, batch_tokens=128)
        return {j: (aux.cpu(), final.cpu()) for j, aux, final in engine.capture(records)}  # yielded on the device

    want = capture("cpu", torch.float32)
    got = capture(DEVICE, dtype)
    H = model.config.hidden_size
    assert sorted(got) == sorted(want) == list(range(len(records)))
    for j, (aux, final) in want.items():
        assert got[j][0].shape == aux.shape == (len(records[j]["input_ids"]), 3 * H)
        assert got[j][0].dtype == dtype
        for i, layer in enumerate(TINY_AUX):
            err = row_relative_error(got[j][0][:, i * H:(i + 1) * H], aux[:, i * H:(i + 1) * H])
            assert err <= CAPTURE_TOL[dtype], f"record {j}, aux layer {layer}: relative error {err}"
        err = row_relative_error(got[j][1], final)
        assert err <= CAPTURE_TOL[dtype], f"record {j}, final state: relative error {err}"


@gpu_test
@pytest.mark.parametrize("launcher", ["single_gpu", "deepspeed_zero2", "fsdp2"])
def test_launcher_trains_resumes_exactly_after_sigkill_and_exports(launcher, tiny_target, prepared, tmp_path):
    if launcher == "deepspeed_zero2":
        skip_without_deepspeed()
    prompts, data = prepared
    recipe = launcher_recipe(tiny_target, prompts)
    recipe_path = tmp_path / "recipe.yaml"
    dump_recipe(recipe, recipe_path)
    config = launcher_config(launcher, recipe, tmp_path)
    ref, run = new_run(data, tmp_path / "ref"), new_run(data, tmp_path / "run")
    with Jobs(tmp_path / "logs") as jobs:
        jobs.start("uninterrupted", accelerate_cmd(config, recipe_path, ref), child_env())
        killed = jobs.start("killed", accelerate_cmd(config, recipe_path, run), child_env())
        try:
            seen = wait_for_step(run, KILL_AFTER, killed, timeout=TIMEOUT_S)
        except (RuntimeError, TimeoutError) as exc:
            pytest.fail(f"{exc}\n{jobs.log('killed')[-4000:]}")
        kill_tree(killed)
        resume_from = find_checkpoints(run / "checkpoints")[-1]
        states = [json.loads((resume_from / "train_state.json").read_text())]
        assert states[0]["step"] < LAUNCH_TRAIN["max_steps"], "the run finished before it was killed"
        jobs.start("resumed", accelerate_cmd(config, recipe_path, run, "--resume"), child_env())
        jobs.finish("uninterrupted")
        resumed_log = jobs.finish("resumed")
    assert f"resumed from {resume_from}" in resumed_log, resumed_log[-4000:]

    final_ref, final = (find_checkpoints(r / "checkpoints")[-1] for r in (ref, run))
    assert ckpt_step(final) == ckpt_step(final_ref) == LAUNCH_TRAIN["max_steps"]
    states += [json.loads((c / "train_state.json").read_text()) for c in (final, final_ref)]
    for saved in states:  # the launcher's engine was in effect in every run
        assert (saved["distributed_type"], saved["num_processes"]) == (DISTRIBUTED_TYPE[launcher], 1)
    weights, weights_ref = (strip_module(load_file(str(c / "model.safetensors"))) for c in (final, final_ref))
    diff = max_param_diff(weights, weights_ref)
    assert diff <= RESUME_TOL, f"{launcher}: SIGKILL after step {seen}, resumed from {resume_from.name}: max |diff| {diff}"
    curve, curve_ref = read_metrics(run), read_metrics(ref)
    assert [m["step"] for m in curve] == [m["step"] for m in curve_ref] == list(range(1, LAUNCH_TRAIN["max_steps"] + 1))
    assert [m["loss"] for m in curve] == pytest.approx([m["loss"] for m in curve_ref], rel=RESUME_TOL, abs=RESUME_TOL)

    out = tmp_path / "export"
    exported = subprocess.run([sys.executable, "-m", "draftsmith.cli.export", str(run), "--out", str(out)],
                              capture_output=True, text=True, env=child_env(), timeout=TIMEOUT_S)
    assert exported.returncode == 0, exported.stderr[-4000:]
    cfg = read_draft(final).config
    export = load_file(str(out / "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in export.items()} == expected_weight_shapes(cfg)
    for k, v in export.items():  # the export may upcast (bf16 under DeepSpeed -> fp32): exact either way
        assert torch.equal(v, weights[k].to(v.dtype)), f"{k} differs from {final / 'model.safetensors'}"
    model = Eagle3DraftModel(cfg)
    missing, unexpected = model.load_state_dict(export, strict=False)
    assert not missing and not unexpected


def test_launcher_configs_written_for_the_gpu_tests_pass_draftsmiths_launcher_checks(tiny_target, tmp_path):
    """CPU check of what the launcher test runs on a GPU: each one-process config is valid for
    accelerate and for draftsmith (the DeepSpeed JSON's numbers agree with the recipe)."""
    from draftsmith.train.launchers import validate_launcher

    recipe = launcher_recipe(tiny_target, write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}]))
    expected = {"single_gpu": ("NO", None), "single_gpu_fp32": ("NO", None), "deepspeed_zero2": ("DEEPSPEED", 2),
                "fsdp2": ("FSDP", None)}
    for name, (distributed_type, zero_stage) in expected.items():
        report = validate_launcher(recipe, launcher_config(name, recipe, tmp_path))
        assert (report.distributed_type, report.num_processes, report.zero_stage) == (distributed_type, 1, zero_stage)
        assert report.gradient_clipping == recipe.train.max_grad_norm
        if name.startswith("single_gpu"):  # (DeepSpeed's precision is in its JSON, not the YAML)
            assert report.mixed_precision == ("no" if name == "single_gpu_fp32" else "bf16")


GPTOSS20B = os.environ.get("DRAFTSMITH_GPTOSS20B", "openai/gpt-oss-20b")


def _local_checkpoint(name: str) -> Path | None:
    """A local directory of ``name`` (a path, or a snapshot already in the Hugging Face cache):
    the GPU machines here have no network, so the test never downloads 13 GB."""
    if Path(name).is_dir():
        return Path(name)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, local_files_only=True))
    except Exception:  # not cached
        return None


@gpu_test
def test_gptoss20b_capture_through_vllm_returns_all_four_states(tmp_path):
    """Two prompts through vLLM's extract_hidden_states on gpt-oss-20b (MXFP4): the three aux
    states and the state after the last layer (id N = 24) come back for every token, the final
    norm applied; vLLM's gpt-oss model emitting id N was never checked on a GPU before."""
    from draftsmith.target import vllm_capture as vhs
    from draftsmith.recipe import VllmConfig

    path = _local_checkpoint(GPTOSS20B)
    if path is None:
        pytest.skip(f"{GPTOSS20B} is not on this machine (set DRAFTSMITH_GPTOSS20B to a local copy)")
    cfg = json.loads((path / "config.json").read_text())
    n = cfg["num_hidden_layers"]
    ids = [2, n // 2, n - 3]
    engine = vhs.VllmHiddenStateCapture(path, ids, VllmConfig(dtype="bfloat16", max_model_len=1024,
                                                              gpu_memory_utilization=0.6),
                                        work_dir=tmp_path / "work", batch_tokens=4096)
    try:
        records = [{"id": f"r{i}", "input_ids": list(range(1000 + 50 * i, 1000 + 50 * i + 40 + i))} for i in range(2)]
        got = {j: (aux, fin) for j, aux, fin in engine.capture(records)}
    finally:
        engine.close()
    H = cfg["hidden_size"]
    assert sorted(got) == [0, 1]
    for j, (aux, fin) in got.items():
        T = len(records[j]["input_ids"])
        assert aux.shape == (T, 3 * H) and fin.shape == (T, H)
        assert torch.isfinite(aux).all() and torch.isfinite(fin).all()
        # the final norm was applied: each token's state has RMS ~ the norm weight's scale, not the residual's
        assert not torch.equal(aux[:, 2 * H:], fin)
