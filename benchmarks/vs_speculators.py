"""Side by side: one EAGLE-3 training step of vLLM's ``speculators`` 0.9.0 and of draftsmith, same shapes.

    python -m benchmarks.vs_speculators [--recipe llama3_1_8b|gptoss120b|PATH] [--tokens N]
        [--steps 5] [--warmup 2] [--ttt-steps K] [--only speculators|draftsmith] [--out FILE]
    python -m benchmarks.vs_speculators --tiny --device cpu          # the CPU dry run (docs/vs_speculators.md)

What is timed, per trainer, on one packed row of ``--tokens`` tokens (default: the recipe's
``train.batch_size x data.max_length``, 8192 for both GPU recipes), documents drawn from
:func:`benchmarks.lengths.default_lengths` at the recipe's ``data.max_length`` and cut to fill the
row exactly, every position real and loss-bearing (``loss_mask`` all ones):

- **speculators**: its ``Eagle3DraftModel`` (``speculators.models.eagle3.core``) called directly
  with the packed ``(1, T)`` inputs its trainer hands it (``hidden_states`` = the 3 aux states,
  ``verifier_last_hidden_states``, ``input_ids``, ``document_ids``, per-document ``position_ids``,
  ``loss_mask``; bf16 hidden states, its ``hidden_states_dtype`` default), ``ttt_steps`` K and
  ``ttt_step_loss_decay`` = the recipe's ``draft.gamma``, ``loss_config`` kl_div (its fused Triton
  loss on CUDA, its eager loss elsewhere), the step of ``speculators.train.trainer``: forward under
  ``torch.autocast(bf16)`` with fp32 weights, ``zero_grad``, ``backward``, ``clip_grad_norm_(1.0)``,
  ``torch.optim.AdamW`` (its ``build_optimizers`` default; the LR scheduler's step is left out).
  The model is built by its own ``from_training_args`` (t2d / d2t of the draft vocab, verifier
  weights loaded by ``load_verifier_weights`` from a synthetic verifier folder: the target's
  ``config.json`` from ``recipes/targets/`` and a ``model.safetensors`` holding
  ``model.embed_tokens.weight``, ``lm_head.weight`` and ``model.norm.weight`` at the real shape,
  random, written on this machine), with the draft layer geometry draftsmith builds for the recipe
  (:class:`~draftsmith.models.eagle3.config.Eagle3Config`: one Llama layer, the target's MLP width,
  ``draft.sliding_window``, ``norm_before_residual`` and the EAGLE-3.1 flags of the recipe) and
  ``simple_flex_attention`` (its default; ``--speculators-attn``). On CUDA its ``forward`` is
  ``torch.compile``'d by the library itself (``conditional_torch_compile``); the warm-up steps
  pay that.
- **draftsmith**: :func:`benchmarks.gpu.bench_training`, the real training step of the recipe's
  method (at ``--draftsmith-rows`` B x T / B, default 1 x T: the same row; B = the recipe's batch
  size gives its native micro-batch shape over the same tokens and documents) (``compute_loss`` with the chunked / fused loss inside the draft's forward, backward,
  clipping at ``train.max_grad_norm``, the non-finite guard, the optimizer of the recipe forced to
  AdamW) at ``1 x T`` with the same documents, on the launcher's precision path (``--precision
  auto``: Llama's FSDP recipe bf16 autocast with fp32 weights, gpt-oss's DeepSpeed recipe bf16
  weights; fp32 without a launcher), ``train.attention_backend`` auto (flex on CUDA, SDPA on a
  CPU) and ``train.compile`` auto (the decoder layer's regions compiled on CUDA).

Per trainer: ms/step, loss tok/s (loss-bearing input positions per second: ``loss_mask.sum()``,
here every token of the row), the rows the TTT steps run the ``lm_head`` / loss over (speculators:
K x T, every position of every step; draftsmith: the batch plan's sum of M_k, the positions whose
step-k target lies inside their document), trainable parameters (speculators 0.9 freezes its
``lm_head``, draftsmith trains it unless ``--set draft.freeze_lm_head=true``), CUDA peak memory over the timed steps
(``max_memory_allocated``, one process, the other trainer's state freed first) and the first
warm-up step's seconds (compilation); then the ratios ours / theirs.

On a device without a flex backward (a CPU), the speculators step is tried once whole: if its
backward raises, the error is printed and both trainers are timed forward-only (the training
forward with autograd recording, no backward, no optimizer step), beside draftsmith's whole
step. speculators' ``Eagle3DraftModel`` import pulls its data pipeline (``speculators.train.data``:
openai, datasets, hs_connectors) for one type alias; where those are not importable (the lent GPU
machine), that one module is replaced by a stub defining the alias (reported in the output).

Exit 0; 1 when a trainer's measurement failed (recorded, the other still runs); 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu import GiB, free_memory, recipe_path, setup_device, synchronize, time_steps

DEFAULT_RECIPE = "llama3_1_8b"
# --tiny: a tiny Llama target (8 layers: aux layers 2, 4, 5) under the SmolLM2 recipe (no launcher: fp32
# for draftsmith; the speculators step autocasts to bf16 as its trainer does on any device)
TINY_RECIPE = "smollm2_135m"
TINY_TOKENS, TINY_DOC_MAX, TINY_VD = 256, 96, 256
TINY_TARGET = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1024, "hidden_size": 128,
    "intermediate_size": 256, "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 32, "hidden_act": "silu", "rms_norm_eps": 1e-5, "max_position_embeddings": 4096,
    "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "float32",
}
# the recipe settings the comparison pins for draftsmith: AdamW (speculators' default optimizer) and packed rows
FORCED_SETS = ("train.optimizer=adamw", "train.packing=true")
SPECULATORS_VERSION = "0.9.0"
# what speculators' Eagle3 import reaches only through speculators.train.data (its data pipeline)
DATA_PIPELINE_MODULES = ("openai", "datasets", "hs_connectors")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# the shared geometry and documents


def packed_documents(tokens: int, doc_max: int, seed: int = 0) -> list[int]:
    """Document lengths filling one row of exactly ``tokens`` tokens: the default length
    distribution of :mod:`benchmarks.lengths` at ``doc_max``, in draw order, the last one cut."""
    from benchmarks.lengths import default_lengths

    lengths = default_lengths(doc_max, n=max(64, tokens // 16 + 1), seed=seed)
    docs, total = [], 0
    for n in lengths:
        n = min(n, tokens - total)
        docs.append(n)
        total += n
        if total == tokens:
            return docs
    docs.append(tokens - total)
    return docs


def split_rows(docs: list[int], rows: int, tokens: int) -> list[list[int]]:
    """The documents of one packed row of ``tokens`` re-packed into ``rows`` rows of ``tokens /
    rows`` tokens each, in order (a document crossing a row end is cut in two)."""
    width = tokens // rows
    out: list[list[int]] = [[] for _ in range(rows)]
    r, room = 0, width
    for n in docs:
        while n > 0:
            take = min(n, room)
            out[r].append(take)
            n -= take
            room -= take
            if room == 0 and r + 1 < rows:
                r, room = r + 1, width
    return out


def load_setup(args: argparse.Namespace) -> dict[str, Any]:
    """The recipe at ``1 x T`` (benchmarks.gpu's loader), the target's config, the draft geometry
    draftsmith builds for it and the documents of the row."""
    from draftsmith.models.eagle3.config import EAGLE31_OPTIONS, Eagle3Config
    from draftsmith.recipe import load_recipe
    from draftsmith.target import aux_layer_ids

    from benchmarks.gpu import load_bench_recipe, target_config
    from benchmarks.memory import Precision

    sets = list(FORCED_SETS) + list(args.set or [])
    if args.ttt_steps:
        sets.append(f"draft.ttt_steps={args.ttt_steps}")
    if args.tiny:
        sets.append(f"data.draft_vocab_size={TINY_VD}")
    base = load_recipe(recipe_path(args.recipe), sets)
    if base.draft.method != "eagle3":
        raise ValueError(f"{args.recipe}: draft.method {base.draft.method!r}; this benchmark compares EAGLE-3")
    tokens = args.tokens or base.train.batch_size * base.data.max_length
    doc_max = args.doc_max or base.data.max_length
    if tokens % args.draftsmith_rows:
        raise ValueError(f"--tokens {tokens} is not a multiple of --draftsmith-rows {args.draftsmith_rows}")
    ns = argparse.Namespace(target_config=args.target_config, batch_size=args.draftsmith_rows,
                            max_length=tokens // args.draftsmith_rows)
    recipe, config_json, source, launch = load_bench_recipe(args.recipe, sets, ns)
    precision = Precision.of(launch, args.precision)
    target = target_config(config_json, recipe.target.trust_remote_code)
    from draftsmith.target import text_config

    text = text_config(target)
    V, H, n_layers = int(text.vocab_size), int(text.hidden_size), int(text.num_hidden_layers)
    aux = aux_layer_ids(recipe.data.aux_layer_ids, n_layers)
    Vd = min(int(recipe.data.draft_vocab_size), V)
    draft = Eagle3Config.from_target(target, draft_vocab_size=Vd, aux_layer_ids=aux,
                                     norm_before_residual=recipe.draft.norm_before_residual,
                                     sliding_window=recipe.draft.sliding_window,
                                     **{k: getattr(recipe.draft, k) for k in EAGLE31_OPTIONS})
    docs = packed_documents(tokens, doc_max, recipe.seed)
    return {"recipe": recipe, "config_json": config_json, "source": source, "launch": launch,
            "precision": precision, "tokens": tokens, "docs": docs,
            "rows": split_rows(docs, args.draftsmith_rows, tokens),
            "doc_max": doc_max, "V": V, "H": H, "Vd": Vd, "aux": aux, "draft": draft,
            "K": int(recipe.draft.ttt_steps), "gamma": float(recipe.draft.gamma)}


# ---------------------------------------------------------------------------------------------
# speculators


def import_speculators(force_stub: bool = False) -> tuple[Any, str]:
    """``(Eagle3DraftModel class, how it was imported)``: the library as installed; where its data
    pipeline's packages are missing (or ``force_stub``), with ``speculators.train.data`` stubbed
    (the one name the model package imports from it, ``BatchType``)."""
    missing = [m for m in DATA_PIPELINE_MODULES if importlib.util.find_spec(m) is None]
    how = "as installed"
    if (missing or force_stub) and "speculators.train.data" not in sys.modules:
        stub = types.ModuleType("speculators.train.data")
        stub.BatchType = dict[str, Any]  # type: ignore[attr-defined]
        stub.__doc__ = "benchmarks.vs_speculators: stand-in for speculators' data pipeline (not used by the model)"
        sys.modules["speculators.train.data"] = stub
        why = f"{', '.join(missing)} not importable here" if missing else "--stub-speculators-data"
        how = f"with speculators.train.data stubbed ({why}; the model never calls the data pipeline)"
    from speculators.models.eagle3.core import Eagle3DraftModel

    return Eagle3DraftModel, how


def write_verifier(folder: Path, config_json: dict[str, Any], V: int, H: int, dtype: torch.dtype,
                   dev: torch.device, seed: int) -> dict[str, Any]:
    """The verifier folder speculators' Eagle3 reads: ``config.json`` (the target's) and one
    ``model.safetensors`` with the embedding, ``lm_head`` (N(0, 0.02^2), drawn on ``dev``) and the
    final norm, in the target's dtype."""
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config_json))
    g = torch.Generator(device=dev).manual_seed(seed)
    tensors = {}
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        tensors[name] = (torch.randn(V, H, device=dev, generator=g) * 0.02).to(dtype).cpu()
    tensors["model.norm.weight"] = (1 + 0.1 * torch.randn(H, device=dev, generator=g)).to(dtype).cpu()
    save_file(tensors, str(folder / "model.safetensors"))
    size = (folder / "model.safetensors").stat().st_size
    del tensors
    return {"path": str(folder), "bytes": size, "seconds": time.perf_counter() - t0}


def speculators_inputs(s: dict[str, Any], dev: torch.device, seed: int) -> dict[str, torch.Tensor]:
    """The packed ``(1, T)`` batch speculators' Eagle3 forward takes (after its ``shift_batch``),
    drawn on ``dev``: bf16 aux / final hidden states, random ids, every position in the loss."""
    T, H, V, docs = s["tokens"], s["H"], s["V"], s["docs"]
    g = torch.Generator(device=dev).manual_seed(seed)
    n_aux = len(s["aux"])
    lengths = torch.tensor(docs, device=dev)
    return {
        "hidden_states": torch.randn(1, T, n_aux * H, device=dev, generator=g).to(torch.bfloat16),
        "verifier_last_hidden_states": torch.randn(1, T, H, device=dev, generator=g).to(torch.bfloat16),
        "input_ids": torch.randint(0, V, (1, T), device=dev, generator=g),
        "loss_mask": torch.ones(1, T, dtype=torch.bool, device=dev),
        "document_ids": torch.repeat_interleave(torch.arange(len(docs), device=dev), lengths).unsqueeze(0),
        # per document, from 1 (shift_batch drops each sample's first position)
        "position_ids": torch.cat([torch.arange(1, n + 1, device=dev) for n in docs]).unsqueeze(0),
    }


def build_speculators(cls: Any, s: dict[str, Any], verifier: str, attn: str) -> torch.nn.Module:
    """speculators' draft from its own ``from_training_args`` with draftsmith's layer geometry."""
    from transformers import LlamaConfig

    layer = {k: v for k, v in s["draft"].to_layer_config().items() if k != "architectures"}
    layer_config = LlamaConfig.from_dict(layer)
    V, Vd = s["V"], s["Vd"]
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[:Vd] = True  # draft id i -> target id i (the draftsmith side's vocab, benchmarks.memory.offline_method)
    d2t = torch.zeros(Vd, dtype=torch.long)  # offsets: target id - draft id
    d = s["draft"]
    return cls.from_training_args(
        verifier_config=layer_config, t2d=t2d, d2t=d2t, verifier_name_or_path=verifier, draft_vocab_size=Vd,
        norm_before_residual=d.norm_before_residual, norm_before_fc=d.norm_before_fc, fc_norm=d.fc_norm,
        norm_output=d.norm_output, embed_requires_grad=False, ttt_steps=s["K"], target_layer_ids=list(s["aux"]),
        draft_attn_impl=attn)


def raised_at(exc: BaseException) -> str:
    """Where ``exc`` was raised: the innermost speculators frame and the innermost frame."""
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return "?"
    short = lambda f: f"{f.filename.split('site-packages/')[-1]}:{f.lineno} ({f.name})"  # noqa: E731
    theirs = [f for f in frames if "speculators/" in f.filename]
    return short(frames[-1]) + (f", called from {short(theirs[-1])}" if theirs and theirs[-1] is not frames[-1] else "")


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:400]


def bench_speculators(s: dict[str, Any], args: argparse.Namespace, dev: torch.device, workdir: Path) -> dict[str, Any]:
    """speculators' step (module docstring): build, try one whole step, time whole steps (or,
    where the whole step raised, forward-only ones)."""
    out: dict[str, Any] = {"trainer": f"speculators {SPECULATORS_VERSION}", "error": None}
    t0 = time.perf_counter()
    cls, how = import_speculators(args.stub_speculators_data)
    out["import"] = how
    out["import_s"] = time.perf_counter() - t0
    from speculators.losses import resolve_loss_config

    loss_impl = args.speculators_loss or ("fused" if dev.type == "cuda" else "eager")
    out.update(loss_name=f"kl_div ({loss_impl})", attention=args.speculators_attn,
               precision="bf16 autocast, fp32 weights (its trainer's torch.autocast(hidden_states_dtype=bf16))",
               optimizer="torch.optim.AdamW (foreach default), clip_grad_norm_ 1.0",
               compiled="forward torch.compile'd by the library (CUDA)" if dev.type == "cuda" else "eager (no CUDA)")
    t0 = time.perf_counter()
    verifier = write_verifier(workdir / "verifier", s["config_json"], s["V"], s["H"],
                              getattr(torch, s["recipe"].target.dtype), dev, args.seed)
    inputs = speculators_inputs(s, dev, args.seed + 1)
    synchronize(dev)
    out["verifier_folder"] = verifier
    out["inputs_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    model = build_speculators(cls, s, verifier["path"], args.speculators_attn).to(dev)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=s["recipe"].train.lr, weight_decay=0.0)
    out["build_s"] = time.perf_counter() - t0
    out["trainable_parameters"] = sum(p.numel() for p in params)
    loss_config = resolve_loss_config("kl_div", loss_impl)
    call = {"ttt_steps": s["K"], "ttt_step_loss_decay": s["gamma"], "loss_config": loss_config}
    last: dict[str, Any] = {}

    def forward() -> torch.Tensor:
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            _draft_tokens, loss, _metrics = model(**inputs, **call)
        return loss

    def whole(i: int) -> None:
        loss = forward()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        last["loss"] = loss.detach()

    def forward_only(i: int) -> None:
        last["loss"] = forward().detach()

    def forward_no_grad(i: int) -> None:
        with torch.no_grad():
            last["loss"] = forward()

    step, mode = whole, "forward + backward + AdamW"
    if dev.type != "cuda":  # flex_attention's backward on this device: probe one whole step first
        t1 = time.perf_counter()
        try:
            loss = forward()
        except Exception as exc:  # noqa: BLE001 - the CPU case (torch refuses flex with grad): forward under no_grad
            out["grad_forward_error"] = first_line(exc)
            out["grad_forward_raised_at"] = raised_at(exc)
            t1 = time.perf_counter()
            try:
                with torch.no_grad():
                    loss = forward()
            except Exception as exc2:  # noqa: BLE001 - reported; nothing to time
                out["error"] = f"forward raised {first_line(exc2)} (with autograd: {out['grad_forward_error']})"
                out["how_far"] = out["error"]
                return out
            out["probe_forward_s"] = time.perf_counter() - t1
            out["how_far"] = (f"the training forward (autograd on) raised {out['grad_forward_error']} in "
                              f"{out['grad_forward_raised_at']}, before any backward; under torch.no_grad the whole "
                              f"forward ran "
                              f"(all {s['K']} TTT steps and the loss: {1e3 * out['probe_forward_s']:.0f} ms, loss "
                              f"{float(loss):.4f}); no backward or optimizer step is possible here")
            out["backward_error"] = out["grad_forward_error"]
            step, mode = forward_no_grad, "forward only (torch.no_grad: no autograd, backward or optimizer step)"
        else:
            out["probe_forward_s"] = time.perf_counter() - t1
            try:
                opt.zero_grad()
                loss.backward()
                out["how_far"] = "forward and backward ran on this device"
                opt.zero_grad(set_to_none=True)
            except Exception as exc:  # noqa: BLE001 - degrade to forward-only timing
                out["backward_error"] = first_line(exc)
                out["backward_raised_at"] = raised_at(exc)
                out["how_far"] = (f"forward ran ({1e3 * out['probe_forward_s']:.0f} ms, loss {float(loss):.4f}); "
                                  f"backward raised {out['backward_error']}")
                step, mode = forward_only, "forward only (training forward with autograd, no backward / optimizer)"
        del loss
    out["timed"] = mode
    try:
        seconds, mem = time_steps(step, args.steps, args.warmup, dev)
    except Exception as exc:  # noqa: BLE001 - recorded; the other trainer still runs
        out["error"] = first_line(exc)
        return out
    out.update(seconds=seconds, memory=mem, final_loss=float(last["loss"]) if "loss" in last else None)
    out["head_rows_per_step"] = s["K"] * s["tokens"]  # every position's logits at every TTT step
    return out  # the model, optimizer and inputs go with this frame (the caller resets dynamo, which holds them)


# ---------------------------------------------------------------------------------------------
# draftsmith


def draftsmith_recipe(s: dict[str, Any], dev: torch.device) -> Any:
    from draftsmith.models.common import resolve_attention_backend

    r = s["recipe"].model_copy(deep=True)
    r.train.attention_backend = resolve_attention_backend(r.train.attention_backend, dev)
    return r


def ttt_rows(s: dict[str, Any]) -> int:
    """Rows draftsmith's TTT steps train (the batch plan's sum of M_k) on its rows' documents."""
    from draftsmith.train.labels import ttt_prediction_masks

    docs = torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in s["rows"]])
    masks = ttt_prediction_masks(torch.ones(docs.shape, dtype=torch.long), s["K"], docs)
    return int(sum(int(m.sum()) for m in masks))


def bench_draftsmith(s: dict[str, Any], args: argparse.Namespace, dev: torch.device,
                     forward_only: str | None = None) -> dict[str, Any]:
    """draftsmith's whole step (:func:`benchmarks.gpu.bench_training`) or, ``forward_only``
    (``"grad"``: autograd recording; ``"no_grad"``: under ``torch.no_grad``, as the speculators
    side had to run), its ``compute_loss`` alone on the same builders."""
    from draftsmith.models.common import resolve_compile

    from benchmarks.gpu import bench_training

    r = draftsmith_recipe(s, dev)
    out: dict[str, Any] = {"trainer": "draftsmith", "error": None, "precision": s["precision"].name,
                           "attention": r.train.attention_backend, "loss_name": f"{r.draft.loss} (chunked / fused)",
                           "optimizer": ", ".join(["AdamW (train.components.optimizer)", f"clip {r.train.max_grad_norm}"]),
                           "compiled": "decoder layer regions (train.compile)" if resolve_compile(r.train.compile, dev)
                           else "eager", "head_rows_per_step": ttt_rows(s)}
    try:
        if forward_only:
            m = _draftsmith_forward_only(r, s, dev, args, no_grad=forward_only == "no_grad")
            out["timed"] = ("forward only (compute_loss under torch.no_grad)" if forward_only == "no_grad" else
                            "forward only (compute_loss with autograd, no backward / optimizer)")
        else:
            m = bench_training(r, s["config_json"], s["precision"], dev, args.steps, args.warmup,
                               count_executed=False, seed=args.seed, rows=s["rows"],
                               length=s["tokens"] // len(s["rows"]))
            out["timed"] = "forward + backward + AdamW (benchmarks.gpu.bench_training)"
            out["fused_loss_launches_per_step"] = m["fused_loss_launches"] / args.steps
            out["compiled_regions"] = f"{m['compiled_regions']}/{m['compile_regions']}"
            out["final_metrics"] = m["metrics"]
    except Exception as exc:  # noqa: BLE001 - recorded; exit 1
        out["error"] = first_line(exc)
        return out
    out.update(seconds=m["seconds"], memory=m["memory"], trainable_parameters=m.get("trainable_parameters"),
               loss_tokens=m["loss_tokens"])
    return out


def _draftsmith_forward_only(r: Any, s: dict[str, Any], dev: torch.device, args: argparse.Namespace,
                             no_grad: bool = False) -> dict[str, Any]:
    """bench_training's build (benchmarks.memory's builders), timing ``compute_loss`` alone
    (``no_grad``: under ``torch.no_grad``)."""
    from draftsmith.models.common import compile_regions, resolve_compile

    from benchmarks.memory import (
        _device_batch,
        offline_method,
        prepare_model,
        random_batch,
        random_weights,
    )

    torch.manual_seed(args.seed)
    with offline_method(r, s["config_json"], getattr(torch, r.target.dtype), random_weights) as method:
        H, V = int(method.target_info.hidden_size), int(method.target_info.vocab_size)
        model, trainable, _optimizers = prepare_model(method, r, s["precision"], dev)
        if resolve_compile(r.train.compile, dev):
            compile_regions(model)
        plan = method.batch_plan() if hasattr(method, "batch_plan") else None
        batch = _device_batch(random_batch(r, H, V, len(method.target_info.aux_layer_ids), fake=False,
                                           seed=args.seed, rows=s["rows"], length=s["tokens"] // len(s["rows"])),
                              plan, dev, None, fake=False)

        def step(i: int) -> None:
            method.begin_step(i)
            with torch.no_grad() if no_grad else contextlib.nullcontext():
                method.compute_loss(model, batch)

        seconds, mem = time_steps(step, args.steps, args.warmup, dev)
        return {"seconds": seconds, "memory": mem, "loss_tokens": int(batch["loss_mask"].sum()),
                "trainable_parameters": sum(p.numel() for p in trainable)}


# ---------------------------------------------------------------------------------------------
# the command


def finish(row: dict[str, Any], s: dict[str, Any], steps: int) -> dict[str, Any]:
    if row.get("error") or "seconds" not in row:
        return row
    per_step = row["seconds"] / steps
    loss_tokens = row.get("loss_tokens", s["tokens"])
    mem = row["memory"]
    row.update(ms_per_step=1e3 * per_step, loss_tokens=loss_tokens, loss_tokens_per_s=loss_tokens / per_step,
               cuda_max_allocated=mem["max_allocated"], cuda_allocated_before=mem["allocated_before"],
               first_step_s=mem["first_step_s"])
    return row


def ratios(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any] | None:
    if "ms_per_step" not in ours or "ms_per_step" not in theirs or ours["timed"].split()[0] != theirs["timed"].split()[0]:
        return None
    mem = None
    if ours.get("cuda_max_allocated") and theirs.get("cuda_max_allocated"):
        mem = ours["cuda_max_allocated"] / theirs["cuda_max_allocated"]
    return {"ms_per_step": ours["ms_per_step"] / theirs["ms_per_step"],
            "loss_tokens_per_s": ours["loss_tokens_per_s"] / theirs["loss_tokens_per_s"], "peak_memory": mem,
            "what": ours["timed"].split(" (")[0]}


def unmatched(s: dict[str, Any], dev: torch.device) -> list[str]:
    """What the two steps cannot be made to share (stated with the results)."""
    r = s["recipe"]
    notes = [
        f"draft geometry: both trainers build draftsmith's layer config for the recipe ({s['draft'].intermediate_size} "
        "MLP width, the recipe's norm flags); speculators' own CLI would differ where its defaults do: eagle3 turns "
        "norm_before_fc and norm_output on (pass --set draft.norm_before_fc=true --set draft.norm_output=true to time "
        "that variant on both) and gives an MoE verifier a 3 x H MLP",
        ("trainable: speculators 0.9 freezes its lm_head (the verifier's draft-vocab rows; from_training_args and "
         "load_verifier_weights set requires_grad False), training fc, the layer and its norms; draftsmith trains "
         f"lm_head too unless draft.freeze_lm_head (here {getattr(r.draft, 'freeze_lm_head', None)}): "
         f"{s['Vd'] * s['H']:,} more trainable parameters, their weight gradient and AdamW state; "
         "--set draft.freeze_lm_head=true matches speculators"),
        "teacher: speculators applies its frozen verifier_norm + verifier_lm_head (draft-vocab rows) to the final "
        "hidden states inside its forward; draftsmith the target head over the rows some TTT step needs",
        f"TTT rows: speculators runs lm_head and the loss over all T positions at each of the K steps (K x T = "
        f"{s['K'] * s['tokens']:,} rows), its step-k loss mask a shift of loss_mask that ignores document ends; "
        f"draftsmith only over the positions whose step-k target lies in the same document "
        f"({ttt_rows(s):,} rows)",
        "loss: speculators kl_div over full (T, Vd) logits per step (fused Triton kernel on CUDA); draftsmith "
        f"{r.draft.loss} computed in row chunks inside the draft's forward (its fused kernel where it runs)",
        "precision: speculators always bf16 autocast with fp32 master weights (single process / DDP); draftsmith "
        f"the recipe launcher's path: {s['precision'].name}",
        "embedding: speculators keeps the verifier embedding (V x H) in the draft as an fp32 buffer-like frozen "
        "parameter on the device; draftsmith's frozen target head / embedding in the target dtype",
        "hidden states: speculators bf16 (its hidden_states_dtype); draftsmith data.hidden_states_dtype "
        f"{r.data.hidden_states_dtype} as its loader decodes it",
        "optimizer: speculators torch.optim.AdamW (foreach), its LR scheduler step not timed; draftsmith its "
        "trainer's AdamW (fused where torch has the kernel), the non-finite guard",
        "compilation: speculators torch.compile's its whole forward (CUDA); draftsmith compiles its decoder "
        "layer regions and flex kernels (train.compile, attention_backend)",
        "input tensors: each trainer draws its own random values (same shapes, documents and loss mask); "
        "draftsmith's batch is built on the host and copied before timing, speculators' on the device",
    ]
    if dev.type == "cuda":
        notes.append("TF32: draftsmith's gpu_defaults() turns it on for fp32 matmuls in this process, for both "
                     "trainers (speculators' trainer leaves torch's default); under bf16 autocast the matmuls of "
                     "both are bf16 regardless")
    if dev.type != "cuda":
        notes.append("on a CPU draftsmith attends with SDPA (flex has no CPU backward) while speculators runs "
                     "flex_attention unfused (eager)")
    return notes


def fmt_row(r: dict[str, Any]) -> str:
    if r.get("error"):
        return f"| {r['trainer']} | error: {r['error']} |||||||||"
    def gib(b: int | None) -> str:
        return "-" if b is None else f"{b / GiB:.2f}"

    first = "-" if r.get("first_step_s") is None else f"{r['first_step_s']:.1f}"
    return (f"| {r['trainer']} | {r['timed']} | {r['precision'].split(' (')[0]} | {r['attention']} | {r['compiled']} "
            f"| {r['ms_per_step']:.1f} | {r['loss_tokens_per_s']:,.0f} | {r['head_rows_per_step']:,} "
            f"| {r.get('trainable_parameters') or 0:,} "
            f"| {gib(r.get('cuda_max_allocated'))} | {first} |")


def report(result: dict[str, Any]) -> str:
    st = result["settings"]
    lines = [f"vs speculators {SPECULATORS_VERSION}: recipe {st['recipe']} (target {st['target']}, H {st['H']}, "
             f"V {st['V']}, draft vocab {st['Vd']}, aux layers {st['aux']}), 1 x {st['tokens']} packed tokens "
             f"(draftsmith: {st['draftsmith_shape']}) in "
             f"{st['documents']} documents (<= {st['doc_max']}), K = {st['ttt_steps']} TTT steps, gamma {st['gamma']}",
             f"draft layer: {st['draft_layer']}",
             f"device {st['device']}; {st['steps']} timed steps after {st['warmup']} warm-up; torch {st['torch']}, "
             f"transformers {st['transformers']}"]
    sp = result.get("speculators") or {}
    if sp.get("import"):
        lines.append(f"speculators imported {sp['import']}")
    if sp.get("verifier_folder"):
        v = sp["verifier_folder"]
        lines.append(f"synthetic verifier folder: config.json + model.safetensors {v['bytes'] / 2**20:,.1f} MiB written "
                     f"in {v['seconds']:.1f} s; speculators inputs on the device in {sp['inputs_s']:.1f} s "
                     f"(verifier included), model built in {sp.get('build_s', 0):.1f} s")
    if sp.get("how_far"):
        lines.append(f"speculators on {st['device']}: {sp['how_far']}")
    if result.get("degraded"):
        lines.append(f"DEGRADED: {result['degraded']}")
    lines += ["", "| trainer | timed | precision | attention | compiled | ms/step | loss tok/s | TTT head rows/step "
              "| trainable | peak alloc GiB | first step s |", "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for key in ("speculators", "draftsmith", "draftsmith_whole_step"):
        if result.get(key):
            lines.append(fmt_row(result[key]))
    rt = result.get("ratio")
    if rt:
        mem = "-" if rt["peak_memory"] is None else f"{rt['peak_memory']:.2f}"
        lines += ["", f"ours / theirs ({rt['what']}): ms/step {rt['ms_per_step']:.3f} (below 1: draftsmith faster), "
                  f"loss tok/s {rt['loss_tokens_per_s']:.3f}x, peak memory {mem}"]
    lines += ["", "not matched:"] + [f"- {n}" for n in result["unmatched"]]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict[str, Any]:
    dev = setup_device(args.device)  # TF32 for fp32 matmuls, as draftsmith's trainer sets (speculators sets nothing)
    import transformers

    t0 = time.perf_counter()
    s = load_setup(args)
    log(f"setup in {time.perf_counter() - t0:.1f} s: {len(s['docs'])} documents, T = {s['tokens']}, K = {s['K']}")
    d = s["draft"]
    result: dict[str, Any] = {
        "settings": {
            "recipe": recipe_path(args.recipe).stem, "target_config": s["source"],
            "target": "tiny Llama (TINY_TARGET)" if args.tiny and args.tiny_config else s["recipe"].target.name_or_path,
            "H": s["H"], "V": s["V"], "Vd": s["Vd"], "aux": s["aux"], "tokens": s["tokens"], "documents": len(s["docs"]),
            "document_lengths": s["docs"], "draftsmith_shape": f"{len(s['rows'])} x {s['tokens'] // len(s['rows'])}",
            "doc_max": s["doc_max"], "ttt_steps": s["K"], "gamma": s["gamma"],
            "device": str(dev), "steps": args.steps, "warmup": args.warmup, "torch": torch.__version__,
            "transformers": transformers.__version__,
            "draft_layer": (f"1 Llama layer, intermediate {d.intermediate_size}, {d.num_attention_heads} heads / "
                            f"{d.num_key_value_heads} kv x {d.head_dim}, sliding window {d.sliding_window}, "
                            f"norm_before_residual {d.norm_before_residual}, norm_before_fc {d.norm_before_fc}, "
                            f"fc_norm {d.fc_norm}, norm_output {d.norm_output}"),
        },
        "speculators": None, "draftsmith": None, "draftsmith_whole_step": None, "ratio": None, "degraded": None,
        "unmatched": unmatched(s, dev),
    }

    def save() -> None:  # after each trainer: a run stopped by a deadline keeps what it measured
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=1, default=str))

    forward_only: str | None = None
    if args.only in (None, "speculators"):
        log("speculators ...")
        with tempfile.TemporaryDirectory(prefix="vs-speculators-", dir=args.workdir) as tmp:
            try:
                sp = bench_speculators(s, args, dev, Path(tmp))
            except Exception as exc:  # noqa: BLE001 - recorded; draftsmith still runs
                sp = {"trainer": f"speculators {SPECULATORS_VERSION}", "error": first_line(exc)}
        result["speculators"] = finish(sp, s, args.steps)
        if sp.get("timed", "").startswith("forward only"):
            forward_only = "no_grad" if "no_grad" in sp["timed"] else "grad"
            result["degraded"] = (f"speculators' training step cannot run on {dev} ({sp['backward_error']}): "
                                  "forward-only timing" + ("" if args.only else " for both trainers, draftsmith's "
                                                           "whole step timed beside it"))
        log(f"  {fmt_row(result['speculators'])}")
        save()
        torch._dynamo.reset()  # its compiled forward holds the model
        gc.collect()
        free_memory(dev)
    if args.only in (None, "draftsmith"):
        log("draftsmith ...")
        result["draftsmith"] = finish(bench_draftsmith(s, args, dev, forward_only), s, args.steps)
        result["draftsmith"]["trainer"] = "draftsmith" + (" (forward only)" if forward_only else "")
        log(f"  {fmt_row(result['draftsmith'])}")
        save()
        if forward_only:
            free_memory(dev)
            whole = finish(bench_draftsmith(s, args, dev), s, args.steps)
            whole["trainer"] = "draftsmith (whole step)"
            result["draftsmith_whole_step"] = whole
            log(f"  {fmt_row(whole)}")
    if result["speculators"] and result["draftsmith"]:
        result["ratio"] = ratios(result["draftsmith"], result["speculators"])
    save()
    return result


def build_parser() -> argparse.ArgumentParser:
    from draftsmith.runtime import HelpFormatter

    p = argparse.ArgumentParser(prog="python -m benchmarks.vs_speculators", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("--recipe", default=None,
                   help=f"an EAGLE-3 recipe under recipes/ or a YAML path (default {DEFAULT_RECIPE}; --tiny: "
                        f"{TINY_RECIPE} on a tiny Llama target)")
    p.add_argument("--tokens", type=int, help="T, the packed row's tokens (default: the recipe's train.batch_size x "
                                              f"data.max_length; --tiny {TINY_TOKENS})")
    p.add_argument("--doc-max", type=int, help="longest document of the row (default: data.max_length; --tiny "
                                               f"{TINY_DOC_MAX})")
    p.add_argument("--draftsmith-rows", type=int, default=1, metavar="B",
                   help="draftsmith's micro-batch: the same tokens and documents as B packed rows of T / B (its "
                        "recipes' shape, e.g. 4 x 2048; speculators always takes one (1, T) row)")
    p.add_argument("--ttt-steps", type=int, help="K for both trainers (default: the recipe's draft.ttt_steps)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="recipe override (repeatable)")
    p.add_argument("--target-config", type=Path, help="the target's config.json (default: recipes/targets/)")
    p.add_argument("--tiny", action="store_true", help="a tiny geometry (the CPU dry run)")
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    p.add_argument("--precision", choices=["auto", "fp32", "amp-bf16", "bf16"], default="auto",
                   help="draftsmith's precision path (auto: the recipe launcher's); speculators' is always its "
                        "trainer's bf16 autocast")
    p.add_argument("--steps", type=int, default=5, help="timed steps per trainer")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before them (compilation happens here)")
    p.add_argument("--only", choices=["speculators", "draftsmith"], help="time one trainer")
    p.add_argument("--speculators-attn", default="simple_flex_attention",
                   choices=["simple_flex_attention", "sdpa", "eager"], help="speculators' --draft-attn-impl")
    p.add_argument("--speculators-loss", choices=["fused", "eager"],
                   help="speculators' --loss-implementation (default: fused on CUDA, eager elsewhere: no Triton)")
    p.add_argument("--stub-speculators-data", action="store_true",
                   help="replace speculators.train.data (its data pipeline: openai, datasets, hs_connectors) by a "
                        "stub even where it imports, as on a machine without those packages")
    p.add_argument("--workdir", type=Path, help="where the synthetic verifier folder is written (default: the "
                                                "system temp folder); removed afterwards")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="write the results as one JSON file")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    args.tiny_config = False
    if args.tiny:
        args.recipe = args.recipe or TINY_RECIPE
        args.tokens = args.tokens or TINY_TOKENS
        args.doc_max = args.doc_max or TINY_DOC_MAX
    args.recipe = args.recipe or DEFAULT_RECIPE
    for key in ("tokens", "steps", "doc_max", "ttt_steps", "draftsmith_rows"):
        value = getattr(args, key)
        if value is not None and value < 1:
            p.error(f"--{key.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("error: no CUDA device; on a CPU run `--tiny --device cpu`", file=sys.stderr)
        return 2
    with contextlib.ExitStack() as stack:
        if args.tiny and args.target_config is None:
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="vs-speculators-tiny-")))
            (tmp / "config.json").write_text(json.dumps(TINY_TARGET))
            args.target_config = tmp / "config.json"
            args.tiny_config = True
        result = run(args)
    print(report(result), flush=True)
    failed = [k for k in ("speculators", "draftsmith") if result.get(k) and result[k].get("error")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
