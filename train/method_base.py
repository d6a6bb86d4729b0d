"""What every draft method reads from ``RUN_DIR/data`` and shares around the loop.

:class:`TargetDataMethod` is the common base of the :class:`~draftsmith.train.trainer.DraftMethod`
implementations (EAGLE-3, Medusa, MLP speculator, DFlash, P-EAGLE): the target info written by
``data_prep/prepare.py``, the target's embedding / ``lm_head`` / final norm tensors, the
dataset (offline shards or, in online mode, token ids with the frozen target in the job),
the target hidden states of a batch, and the data-parallel normalisers of per-step losses.
:class:`DraftVocabMethod` adds what EAGLE-3, DFlash and P-EAGLE share (draft vocab, target
head, head initialisation, mask token); :class:`HeadMethod` what Medusa and the MLP speculator
share: K full-vocab heads trained with per-head cross-entropy, computed in chunks of rows inside
the heads' forward (:func:`~draftsmith.train.losses.chunked_distill`).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from ..target.capture import capture_batch
from ..data_prep.conversations import DataError
from ..layout import DraftCheckpointConfig, RunLayout, read_tokenized, read_vocab
from ..recipe import Recipe
from ..target import TargetInfo, load_target, load_target_head_tensors
from ..target.load import final_logit_softcap
from .data import HiddenStateDataset, TokenizedDataset
from .labels import head_targets
from .losses import LossSpec, StepMetrics, TargetDraftHead, head_loss
from .mask_token import resolve_mask_token_id, token_counts
from .validation import ValidationSpec


class TargetDataMethod:
    """Base of the draft methods: target info, target head tensors, dataset, target states.

    Attributes:
        target_info: ``RUN_DIR/data/target.json`` (:class:`~draftsmith.target.TargetInfo`: path,
            hidden_size, vocab_size, aux ids ...);
            with offline shards its ``aux_layer_ids`` are the shard manifest's, the layers the
            states were captured at (what the draft is built, trained and exported with).
        heads: ``embed_tokens [V, H]``, ``lm_head [V, H]``, ``final_norm [H]`` of the target.
        target / tokenizer: the frozen target, loaded when ``data.hidden_states_mode`` is
            ``online`` or the subclass asks for it (``load_target=True``); else None.

    Raises:
        FileNotFoundError: ``RUN_DIR/data/target.json`` missing (data not prepared).
        RunDirMismatchError: the recipe's ``data.aux_layer_ids`` are not the layers the shards
            were captured at.
    """

    name = "base"
    help_text: str | None = None  # the `draftsmith train RECIPE --help` description; None: the generic one
    uses_attention = True  # False: per-position heads, no attention backend (no flex length buckets)
    verify_shards = "header"  # ShardReader verify mode; "full" with --verify-shards

    def __init__(self, recipe: Recipe, run_dir: Path, load_target_model: bool = False):
        self.recipe, self.paths = recipe, RunLayout(run_dir).data
        if not self.paths.target_info.is_file():
            raise FileNotFoundError(f"{self.paths.target_info} missing: run `draftsmith prepare` first")
        self.target_info = TargetInfo.read(self.paths.target_info)
        if recipe.data.hidden_states_mode == "offline":
            self.target_info.aux_layer_ids = self.captured_aux_layer_ids(recipe, run_dir)
        self.target_dir = Path(self.target_info.path)
        self.heads = load_target_head_tensors(self.target_dir)
        self.logit_softcap = final_logit_softcap(self.target_dir)  # Gemma: the teacher's logits as served
        self.target, self.tokenizer = None, None
        if recipe.data.hidden_states_mode == "online" or load_target_model:
            # frozen target in the same job; its states never touch the disk
            self.target, self.tokenizer = load_target(self.target_dir, getattr(torch, recipe.target.dtype),
                                                      recipe.target.trust_remote_code)
        self.accelerator: Any = None

    def captured_aux_layer_ids(self, recipe: Recipe, run_dir: Path) -> list[int]:
        """The aux layer ids of the offline shards (their manifest; ``target.json``'s before the
        shards exist), checked against the recipe's ``data.aux_layer_ids``.

        Raises:
            RunDirMismatchError: the recipe names other layers (one line, both values, the way out).
        """
        from ..data_prep.agreement import RunDirMismatchError, captured_aux_layer_ids, mismatch_message
        from ..data_prep.shards import MANIFEST

        ids = captured_aux_layer_ids(self.paths)
        where = self.paths.hidden_states / MANIFEST
        if ids is None:
            ids, where = list(self.target_info.aux_layer_ids), self.paths.target_info
        wanted = recipe.data.aux_layer_ids
        if wanted and list(wanted) != ids:
            raise RunDirMismatchError(mismatch_message(run_dir, "data.aux_layer_ids", ids, where, list(wanted)))
        return ids

    def dataset(self) -> torch.utils.data.Dataset:
        if self.recipe.data.hidden_states_mode == "online":
            # memory-mapped Arrow rows read by index
            return TokenizedDataset(self.paths, self.recipe.data.max_length)
        # fp8 shards stay fp8 until the device (decoded by train.data.to_device after the copy)
        return HiddenStateDataset(self.paths.hidden_states, max_length=self.recipe.data.max_length,
                                  verify=self.verify_shards, decode_dtype=None)

    def setup(self, accelerator: Any) -> None:
        self.accelerator = accelerator
        if self.target is not None:
            self.target.to(accelerator.device)

    def begin_step(self, step: int) -> None:
        """Most methods train the same way at every step."""

    def target_states(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(aux (B, T, 3H), final (B, T, H))``: from the shards, or from the target (online)."""
        if "aux_hidden_states" in batch:
            return batch["aux_hidden_states"], batch["final_hidden_states"]
        return capture_batch(self.target, batch["input_ids"], batch["attention_mask"],
                             self.target_info.aux_layer_ids)

    def training_states(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`target_states` for a training step: ``aux (B, T, n*H)`` in the dtype of the
        draft's trainable parameters, plus Gaussian noise of standard deviation
        ``draft.aux_noise_std`` (absolute, fresh per call from torch's seeded generator) where the
        recipe asks for it; ``final (B, T, H)`` untouched, so the target's distribution (the
        labels) stays clean. Validation, evaluation and export never call this. The noise
        follows the speculators trainer's ``--noise-std`` (vllm-project/speculators,
        ``src/speculators/train/noise_transforms.py``: added to the concatenated aux hidden
        states of the training split only), Gaussian here where that one is uniform in
        ``[-std, std]`` (standard deviation ``std / sqrt(3)``)."""
        param = next(p for p in model.parameters() if p.requires_grad)
        aux, final = self.target_states(batch)
        aux = aux.to(param.dtype)
        std = getattr(self.recipe.draft, "aux_noise_std", 0.0)
        if std > 0:
            aux = aux + torch.randn_like(aux) * std
        return aux, final

    def global_denominators(self, counts: torch.Tensor) -> torch.Tensor | None:
        """Per-step normalisers for data parallelism from the local token counts ``(K,)`` of
        each step: the global count over the world size (so the averaged gradient is the
        global token mean), clamped to >= 1, as a device tensor (a collective, no host read);
        None on one process (the loss then uses its local counts)."""
        world = self.accelerator.num_processes if self.accelerator is not None else 1
        if world == 1:
            return None
        return (self.accelerator.reduce(counts.float(), reduction="sum") / world).clamp_min(1.0)

    def step_metrics(self, loss: torch.Tensor, m: StepMetrics) -> dict[str, Any]:
        """``loss`` and ``loss_{k}`` / ``acc_{k}`` per step or head, as detached device tensors
        (or floats): the trainer sums them over its log window on the device and reduces them
        over processes only when it logs (``train.log_every``), so a step reads nothing back."""
        metrics: dict[str, Any] = {"loss": loss.detach()}
        for k, (lk, ak) in enumerate(zip(m.loss, m.acc)):
            metrics[f"loss_{k}"] = lk.detach() if isinstance(lk, torch.Tensor) else lk
            metrics[f"acc_{k}"] = ak.detach() if isinstance(ak, torch.Tensor) else ak
        return metrics

    def validation_spec(self) -> ValidationSpec:
        """No simulated acceptance by default; ``val_loss`` and per-step accuracies only."""
        return ValidationSpec()

    @torch.no_grad()
    def validation_sums(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
        """Summed validation counters of one batch (:func:`~draftsmith.train.validation.run_validation`):
        by default the batch's training loss and per-step accuracies, one count per batch
        (methods with token counts and a simulated acceptance override this)."""
        loss, metrics = self.compute_loss(model, batch)
        out: dict[str, Any] = {"loss": float(loss), "loss_count": 1.0}
        for key, value in metrics.items():
            if key.startswith(("acc_", "loss_")):
                out[key], out[f"{key}_count"] = value, 1.0
        return out

    def check_target_vocab(self) -> tuple[int, int]:
        """``(H, V)`` of the target, with the ``lm_head`` checked against ``target.json``.

        Raises:
            ValueError: the target checkpoint's ``lm_head`` is not ``(vocab_size, hidden_size)``.
        """
        H, V = int(self.target_info.hidden_size), int(self.target_info.vocab_size)
        if tuple(self.heads["lm_head"].shape) != (V, H):
            raise ValueError(
                f"{self.paths.target_info}: vocab_size {V} / hidden_size {H}, but the target lm_head in "
                f"{self.target_dir} has shape {tuple(self.heads['lm_head'].shape)}"
            )
        return H, V


class DraftVocabMethod(TargetDataMethod):
    """Drafts that predict over the draft vocab and share the target's embedding (EAGLE-3,
    DFlash, P-EAGLE): the vocab mapping ``d2t`` / ``t2d`` of ``RUN_DIR/data``, the target's
    distribution over the draft vocab (:attr:`target_head`), the head initialisation every such
    draft gets, the mask token of the parallel drafters, and the checkpoint's vocab file.

    Raises:
        ValueError: ``t2d`` covers another number of target ids than the target's ``lm_head``.
    """

    def __init__(self, recipe: Recipe, run_dir: Path):
        super().__init__(recipe, run_dir)
        self.use_vocab(*read_vocab(self.paths), where=self.paths.vocab)
        self.loss = LossSpec.from_recipe(recipe.draft)  # the divergence against the target (draft.loss)

    def use_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor, where: Any = "draft vocab") -> None:
        """Install the draft vocab ``d2t (Vd,)`` / ``t2d (V,)`` and the target head over it.

        Raises:
            ValueError: naming ``where``, when ``t2d`` covers another number of target ids than
                the target's ``lm_head`` rows.
        """
        if self.heads["lm_head"].shape[0] != t2d.shape[0]:
            raise ValueError(
                f"{where}: t2d covers {t2d.shape[0]} target ids but the target lm_head has "
                f"{self.heads['lm_head'].shape[0]} rows (vocab built for another target?)"
            )
        self.d2t, self.t2d = d2t, t2d
        self.target_head = TargetDraftHead.from_full(self.heads["lm_head"], t2d, self.logit_softcap)

    def init_draft(self, model: nn.Module) -> nn.Module:
        """``model`` with the target's embedding, (``draft.init_lm_head_from_target``) its
        ``lm_head`` rows and final norm, the vocab mapping and ``draft.freeze_lm_head`` applied
        (the trainer applies ``draft.gradient_checkpointing``)."""
        init = self.recipe.draft.init_lm_head_from_target
        model.init_from_target(self.heads["embed_tokens"], self.target_head.weight if init else None,
                               self.heads["final_norm"].float() if init else None)
        model.set_vocab_mapping(self.d2t, self.t2d)
        if self.recipe.draft.freeze_lm_head:
            model.lm_head.weight.requires_grad_(False)
        if hasattr(model, "attention_backend"):
            model.attention_backend = self.recipe.train.attention_backend
        return self.warm_start(model)

    def warm_start(self, model: nn.Module) -> nn.Module:
        """``model`` (initialised by :meth:`init_draft`) with the weights of the draft
        ``draft.init_from`` names, for a method whose warm start loads here (the DFlash family:
        :mod:`draftsmith.models.dflash.warm_start`; P-EAGLE: :mod:`draftsmith.models.peagle.warm_start`);
        by default ``model`` unchanged (EAGLE-3 loads its own in ``build_model``)."""
        return model

    def mask_token_id(self, default: int | None = None) -> int:
        """``draft.mask_token_id`` (when unset: ``default``, e.g. the mask token of the
        ``draft.init_from`` draft) checked against every token of the tokenised data, or the
        automatic choice (:func:`~draftsmith.train.mask_token.resolve_mask_token_id`).

        Raises:
            MaskTokenError: the id occurs in the data (its count and a free id in the message).
        """
        from transformers import AutoTokenizer

        tokenizer = self.tokenizer or AutoTokenizer.from_pretrained(
            self.target_dir, trust_remote_code=self.recipe.target.trust_remote_code)
        counts = token_counts(read_tokenized(self.paths), int(self.t2d.shape[0]))
        wanted = self.recipe.draft.mask_token_id
        return resolve_mask_token_id(default if wanted is None else wanted, counts, tokenizer, str(self.paths.tokenized))

    def setup(self, accelerator: Any) -> None:
        super().setup(accelerator)
        self.target_head.to(accelerator.device)

    def checkpoint_extras(self, directory: Path, **extra: Any) -> None:
        """``draft_config.json`` (the method, ``self.config``, the target, ``extra``) and
        ``vocab.safetensors``."""
        DraftCheckpointConfig(method=self.name, config=self.config.to_dict(), target=self.target_info.to_dict(),
                              **extra).write(directory)
        save_file({"d2t": self.d2t, "t2d": self.t2d}, str(directory / "vocab.safetensors"))


class HeadMethod(TargetDataMethod):
    """Medusa heads and MLP-speculator stages: K heads over the full target vocab, fed the
    target's final normed hidden state; per-head cross-entropy weighted ``draft.head_decay**k``.

    The loss is computed inside the model's forward (``head_fn``), per head in chunks of rows
    (:func:`~draftsmith.train.losses.chunked_distill`): no ``(K, M, V)`` logits, and no host
    read in a step whose batch carries its plan (:meth:`batch_plan`).

    Subclasses set :attr:`num_heads` and :attr:`config` (with ``vocab_size``) and implement
    :meth:`head_forward`.
    """

    num_heads: int
    uses_attention = False
    PLAN_KEYS = ("head_index", "head_tokens", "head_labels", "head_label_mask")

    def head_forward(self, model: nn.Module, final: torch.Tensor, tokens: torch.Tensor, head_fn: Any) -> list[Any]:
        """Run the heads on ``final (M, 1, H)`` (every gathered position a length-1 sequence;
        ``tokens (M, K + 2)`` = x_t .. x_{t+K+1}) with ``head_fn`` (``models.medusa.model.HeadFn``);
        returns its K results."""
        raise NotImplementedError

    @staticmethod
    def plan_heads(batch: dict[str, Any], num_heads: int) -> dict[str, Any]:
        """The batch plan of K heads (:meth:`batch_plan`; run on the collated CPU batch in the
        DataLoader, picklable bound with ``functools.partial``): the batch plus

        - ``head_index (M,)`` int64: flat ``b * T + t`` of the M positions where some head has a
          label (:func:`~draftsmith.train.labels.head_targets`);
        - ``head_tokens (M, K + 2)``: x_t .. x_{t+K+1} there (0 past the end);
        - ``head_labels (K, M)``: x_{t+k+2}; ``head_label_mask (K, M)`` bool: head k trains there;
        - ``head_rows`` (python int M) and ``head_counts`` (python list, M_k per head).

        On device tensors (the fallback of :meth:`compute_loss`) it reads the device (boolean indexing).
        """
        t = head_targets(batch["input_ids"], batch["loss_mask"], num_heads, batch.get("document_ids"))
        index = t.positions.flatten().nonzero().squeeze(1)
        return {**batch, "head_index": index, "head_tokens": t.tokens, "head_labels": t.labels,
                "head_label_mask": t.label_mask, "head_rows": int(index.shape[0]),
                "head_counts": t.label_mask.sum(1).tolist()}

    def batch_plan(self) -> Any:
        """:meth:`plan_heads` bound to K: the gathered positions and labels as index tensors,
        computed on the CPU batch, so the step gathers without reading a mask back."""
        return functools.partial(HeadMethod.plan_heads, num_heads=self.num_heads)

    def batch_states(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The batch to train on, with ``final_hidden_states (B, T, H)``; the MLP speculator's
        stage 2 replaces the batch with sequences the target generates."""
        _, final = self.target_states(batch)
        return dict(batch, final_hidden_states=final)

    def compute_loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, Any]]:
        """:func:`~draftsmith.train.losses.head_loss` on the batch's labelled positions (the value and
        gradients of the per-head cross-entropy over ``(K, M, V)`` logits, without building them;
        tests compare the two). Metrics ``loss``, ``loss_{k}``, ``acc_{k}`` are detached 0-dim
        device tensors. No host read when
        the batch carries its plan (:meth:`batch_plan`); otherwise (validation, tests) the plan is
        computed here from the batch."""
        batch = self.batch_states(batch)  # MLP stage 2: a generated batch, without the plan
        plan = batch if self.PLAN_KEYS[0] in batch else self.plan_heads(batch, self.num_heads)
        param = next(p for p in model.parameters() if p.requires_grad)
        final = batch["final_hidden_states"]
        device = final.device
        index, tokens, labels, mask = (plan[key].to(device, non_blocking=True) for key in self.PLAN_KEYS)
        # every gathered position is its own length-1 sequence: heads never mix positions
        final = final.flatten(0, 1).index_select(0, index).to(param.dtype).unsqueeze(1)  # (M, 1, H)
        loss, m = head_loss(lambda head_fn: self.head_forward(model, final, tokens, head_fn), labels, mask,
                            self.recipe.draft.head_decay, self.global_denominators, self.recipe.train.loss_chunk_rows,
                            self.config.vocab_size, plan.get("head_counts"),
                            fused=getattr(self.recipe.train, "fused_loss", None))
        return loss, self.step_metrics(loss, m)

    def draft_config(self) -> dict[str, Any]:
        raise NotImplementedError

    def checkpoint_extras(self, directory: Path) -> None:
        DraftCheckpointConfig(method=self.name, config=self.draft_config(), target=self.target_info.to_dict(),
                              head_decay=self.recipe.draft.head_decay).write(directory)


class DataNotPreparedError(RuntimeError):
    """``--no-prepare`` and the run's data stages have not all run."""


class MethodSetupError(ValueError):
    """A draft method's own inputs do not fit this run (e.g. EAGLE-3's warm start,
    ``draft.init_from``: :class:`~draftsmith.models.eagle3.warm_start.WarmStartError`): raised
    before any step, reported in one line (the training commands exit 1)."""


def ensure_prepared(recipe: Recipe, run_dir: Path, recipe_arg: str, allow: bool = True, poll_s: float = 5.0,
                    device: str | None = None, checked: bool = False) -> list[str]:
    """Run the data stages whose outputs are missing from ``RUN_DIR/data``, rank-safe, before
    the accelerator exists (no training rank has touched a GPU yet).

    First (unless ``checked``: the caller did) the data on disk is compared with the recipe
    (:func:`~draftsmith.data_prep.agreement.check_run_dir`): a run directory prepared with other
    data keys is refused before anything is written.

    One process: :func:`draftsmith.data_prep.prepare.prepare` in this process (its engines are
    closed before it returns). Several processes (``accelerate launch`` / torchrun): the stages
    run in child processes, one per node (regeneration; capture of a target larger than one
    GPU, with vLLM at tensor parallel over the node's GPUs) or one per rank bound to its own GPU
    (capture of a target that fits one), and every rank returns once all of them have exited
    (:func:`draftsmith.data_prep.launch.prepare_in_children`). The plan is printed first. The
    run directory must be on a file system every node sees.

    Returns:
        The stages that were missing (``[]`` when the data was ready).

    Raises:
        RunDirMismatchError: the data on disk was prepared with other recipe keys (one line).
        DataNotPreparedError: ``allow`` is False and a stage is missing; the message is one line
            naming the prepare command.
    """
    import logging

    from ..data_prep.agreement import check_run_dir
    from ..data_prep.launch import launch_layout, prepare_in_children
    from ..data_prep.prepare import data_plan, missing_stages, prepare

    todo = missing_stages(recipe, run_dir)
    if not checked:
        check_run_dir(recipe, run_dir, todo if allow else [], recipe_arg)
    if not todo:
        return []
    if not allow:
        raise DataNotPreparedError(
            f"{run_dir / 'data'} is not prepared (stages missing: {', '.join(todo)}); run: draftsmith prepare "
            f"{recipe_arg} --run-dir {run_dir}   (or drop --no-prepare)")
    lay = launch_layout()
    if lay["rank"] == 0:
        logging.getLogger("draftsmith.train").info("data stages missing in %s: %s; preparing them now",
                                                   run_dir / "data", ", ".join(todo))
    if lay["world"] == 1:
        prepare(recipe, run_dir, todo, device)
    else:
        prepare_in_children(recipe, run_dir, todo, lambda: data_plan(recipe, run_dir, None, todo), poll_s=poll_s)
    return todo


def check_online_target_fits(recipe: Recipe, run_dir: Path) -> None:
    """On a CUDA machine, refuse ``data.hidden_states_mode: online`` before any rank loads the
    target when the target (as transformers loads it) and the draft's training estimate do not
    fit one GPU (:func:`~draftsmith.train.dry_run.check_online_fits`). The GPU's memory comes
    from ``nvidia-smi``, so no rank creates a CUDA context for it.

    Raises:
        MemoryBudgetError: naming both figures.
    """
    if recipe.data.hidden_states_mode != "online" or not torch.cuda.is_available():
        return
    from ..data_prep.plan import gpu_memory_gib
    from .dry_run import check_online_fits, dry_run

    memory = gpu_memory_gib()
    if memory is None:
        return
    target_dir = Path(TargetInfo.read(RunLayout(run_dir).data.target_info).path)
    check_online_fits(dry_run(recipe, target_dir / "config.json", device_memory_gib=memory), memory)


def check_draft_vocab_size(recipe: Recipe, paths: Any) -> None:
    """Before training: the prepared draft vocab (``paths.vocab``) has the recipe's
    ``data.draft_vocab_size`` tokens (capped at the target vocab). Evaluation reads folders in a
    draft's own vocab and does not call this.

    Raises:
        DataError: naming the vocab file and both sizes (data prepared for another recipe, e.g. an
            EAGLE-3 folder handed to DFlash2, which drafts over the whole target vocab).
    """
    from ..data_prep.agreement import remedy

    d2t, t2d = read_vocab(paths)
    want = min(recipe.data.draft_vocab_size, t2d.shape[0])
    if d2t.shape[0] != want:  # the fix is a new prepare whether or not --no-prepare was given
        raise DataError(f"{paths.vocab}: a draft vocab of {d2t.shape[0]} tokens, but the recipe's "
                        f"data.draft_vocab_size is {want}: the data was prepared for another recipe; "
                        f"{remedy(Path(paths.root).parent)}")
