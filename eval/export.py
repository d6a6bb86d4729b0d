"""Export a trained draft checkpoint into a directory vLLM loads, and load exports back.

    draftsmith export RUN_DIR/checkpoints/step-N --out RUN_DIR/export/eagle3 [--legacy] [--dtype bfloat16]
    draftsmith export CKPT OUT_DIR [--vllm 0.33]

One exporter and one loader for every method: :func:`export` reads the checkpoint
(:func:`draftsmith.train.checkpoint.read_draft`), asks the method's format
(``models/<method>/format.py``, found through :mod:`draftsmith.methods`) for the export's tensors
and ``config.json``, writes them and reads the weights back to check what vLLM will read;
:func:`load_export` rebuilds the draft of an export folder with the format its ``config.json``
is. The formats are described in docs/formats.md.

``--vllm VERSION`` names the vLLM release the export must load in (default: the installed one, if
any): an export that release cannot load (vLLM 0.33 no longer has Medusa; XPress drafts need 0.33)
is refused before anything is written, naming the version and the config key
(:mod:`draftsmith.vllm_bridge.releases`, docs/vllm_releases.md). The command line takes only the
releases that table holds (0.32, 0.33): another, or a string that is no version, is refused in one line
naming them (:func:`~draftsmith.vllm_bridge.releases.known_release`), exit 1 as the other refusals.

``--dtype auto`` (the default) writes bfloat16 weights on a machine with a CUDA GPU and
float32 on a CPU-only one; ``--dtype float32`` / ``bfloat16`` / ``float16`` choose explicitly.
K (``--num-speculative-tokens``) defaults to the ``eval.num_speculative_tokens`` of the recipe
saved with the checkpoint for EAGLE-3, and to the trained K for DFlash (``block_size - 1``) and
P-EAGLE (``num_depths``).

Export reads only the checkpoint directory (weights, ``draft_config.json``,
``vocab.safetensors``, ``recipe.yaml``), and for the aux layer ids one file beside it: the aux
layer ids written (``eagle_aux_hidden_state_layer_ids``) are those of ``draft_config.json``,
which training takes from the shard manifest (the layers the states were captured at), never
the saved ``recipe.yaml``; a checkpoint inside a run directory whose shards were captured at
other layers than its config names (trained by a draftsmith that took them from ``target.json``)
is refused (:func:`check_captured_layers`).

An ``OUT_DIR`` that already holds a ``speculation_profile.json`` (``draftsmith acceptance`` of an
earlier export) keeps it only when it records the sha256 and method of the weights just written
(the same bytes exported again); any other is removed, logging one line naming it, so that a
profile of other weights is never published beside these (:func:`drop_stale_profile`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from .. import __version__
from ..layout import DRAFT_CONFIG_FILE, DraftLoadError, ExportError, RunLayout, read_export_config
from ..methods import UnknownMethodError, get_method, method_of_export
from ..models.common import cast_floating, check_tensor_set
from ..runtime import resolve_dtype
from ..train.checkpoint import find_checkpoints, read_draft
from ..vllm_bridge.releases import check_vllm_loads
from .profile import PROFILE_FILE, WEIGHTS_FILE, ProfileError, binding_mismatch, file_sha256, read_profile

log = logging.getLogger(__name__)


def export(ckpt: Path, out: Path, legacy: bool = False, num_speculative_tokens: int | None = None,
           dtype: str = "auto", embed_tokens: torch.Tensor | None = None, vllm_version: str | None = None,
           average: bool = True) -> Path:
    """Write the vLLM-loadable draft of checkpoint ``ckpt`` to ``out`` (created) in the format of
    its method; returns ``out``.

    Args:
        ckpt: training checkpoint directory (``checkpoints/step-N``).
        legacy: EAGLE-3: the legacy ``LlamaForCausalLMEagle3`` layout instead of speculators.
        num_speculative_tokens: K written as the default proposal length (EAGLE-3: default 3;
            DFlash: must be ``block_size - 1``; P-EAGLE: default and at most ``num_depths``).
        dtype: storage dtype of the floating-point weights; ``"auto"`` is bfloat16 when this
            process sees a CUDA GPU and float32 otherwise (:func:`draftsmith.runtime.resolve_dtype`).
        embed_tokens: EAGLE-3: also write the target embedding ``[V, H]`` (vLLM otherwise shares
            the target's).
        vllm_version: the vLLM release the export must load in (``"0.33"``, ``"0.32.0"``); None:
            no check (the command line passes the installed vLLM's).
        average: a checkpoint trained with ``train.ema_decay`` exports its weight average
            (``ema.safetensors``); False: the trained weights.

    Options a method's format does not take (:attr:`~draftsmith.models.common.DraftFormat.export_options`)
    are not used. A ``speculation_profile.json`` already in ``out`` that does not record the new
    weights' sha256 and method is removed (:func:`drop_stale_profile`).

    Raises:
        ExportError: missing files, an invalid or unregistered method, tensors that do not match
            the layout vLLM loads, an option the format refuses, an unknown dtype; an export
            ``vllm_version`` cannot load (names the version and the config key), nothing written.
    """
    try:
        dtype = resolve_dtype(dtype)
    except ValueError as exc:
        raise ExportError(str(exc)) from None
    draft = read_draft(Path(ckpt), average=average)
    check_captured_layers(Path(ckpt), draft)
    fmt = get_method(draft.method).format
    given = {"legacy": legacy or None, "num_speculative_tokens": num_speculative_tokens, "embed_tokens": embed_tokens}
    options = {k: v for k, v in given.items() if v is not None and k in fmt.export_options}
    tensors, config = fmt.export(draft, dtype, __version__, **options)
    try:
        check_vllm_loads(draft.method, config, vllm_version, ckpt)
    except ValueError as exc:
        raise ExportError(str(exc)) from None
    tensors = cast_floating(tensors, dtype)
    out.mkdir(parents=True, exist_ok=True)
    weights = out / WEIGHTS_FILE
    save_file(tensors, str(weights), metadata={"format": "pt"})
    drop_stale_profile(out, _export_method(config, draft.method))
    # what vLLM will read, read back
    check_tensor_set(load_file(str(weights)), {k: tuple(v.shape) for k, v in tensors.items()}, str(weights),
                     fmt.layout)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name, extra in (fmt.sidecars(config) if fmt.sidecars else {}).items():
        (out / name).write_text(json.dumps(extra, indent=2))
    return out


def _export_method(config: dict[str, Any], default: str) -> str:
    """The method an export's ``config.json`` reads as (what ``draftsmith acceptance`` records)."""
    try:
        return method_of_export(config).name
    except UnknownMethodError:
        return default


def drop_stale_profile(out: Path, method: str) -> Path | None:
    """Remove ``out/speculation_profile.json`` unless it records the sha256 of ``out``'s weights
    file and ``method`` (:func:`draftsmith.eval.profile.binding_mismatch`): one without a sha256
    or that does not read cannot be shown to describe them. Logs one line naming the file;
    returns the file removed, None when there was none or it matches.

    Raises:
        OSError: the weights cannot be read or the profile cannot be removed.
    """
    path, weights = out / PROFILE_FILE, out / WEIGHTS_FILE
    if not path.is_file():
        return None
    try:
        why = binding_mismatch(read_profile(path), weights, file_sha256(weights), method)
    except ProfileError as exc:
        why = f"it does not read as a speculation profile ({str(exc).removeprefix(f'{path}: ')})"
    if why is None:
        return None
    path.unlink()
    log.warning("removed %s: %s; measure the new weights with `draftsmith acceptance --target TARGET --draft %s`",
                path, why, out)
    return path


def check_captured_layers(ckpt: Path, draft: Any) -> None:
    """Refuse to export a checkpoint of ``RUN_DIR/checkpoints/`` whose draft config names other aux
    layer ids than the run's hidden-state shards were captured at (``data/hidden_states/manifest.json``):
    vLLM would feed the draft layers it never saw. A checkpoint outside a run directory, of a
    draft without aux layers, or of a run without shards is not checked.

    Raises:
        ExportError: one line naming both lists and both files.
    """
    from ..data_prep.agreement import captured_aux_layer_ids
    from ..data_prep.shards import MANIFEST
    from ..fileio import ShardError

    ids = getattr(draft.config, "aux_layer_ids", None)
    if not ids or ckpt.resolve().parent.name != "checkpoints":
        return
    paths = RunLayout(ckpt.resolve().parent.parent).data
    try:
        captured = captured_aux_layer_ids(paths)
    except ShardError:
        return
    if captured is not None and list(ids) != captured:
        raise ExportError(f"{ckpt / DRAFT_CONFIG_FILE}: aux layer ids {list(ids)}, but the run's hidden states were "
                          f"captured at {captured} ({paths.hidden_states / MANIFEST}): the draft was trained on "
                          "other layers than its config names; train it again with this draftsmith")


def load_export(path: Path, embed_tokens: torch.Tensor | None = None,
                lm_head: torch.Tensor | None = None) -> torch.nn.Module:
    """The draft of an export folder (float32, eval mode), with the loader of the format its
    ``config.json`` is (:func:`draftsmith.methods.method_of_export`).

    Args:
        embed_tokens / lm_head: the target's, used by the drafts that share them when the export
            ships none (EAGLE-3, P-EAGLE: the embedding; DFlash: both).

    Raises:
        DraftLoadError: no ``config.json``, or a format no registered method has; and what the
            format's loader raises.
    """
    path = Path(path)
    try:
        spec = method_of_export(read_export_config(path))
    except UnknownMethodError as exc:
        raise DraftLoadError(f"{path / 'config.json'}: unknown draft format ({exc})") from None
    return spec.format.load(path, embed_tokens, lm_head)


def saved_num_speculative_tokens(ckpt: Path, default: int = 3) -> int:
    """``eval.num_speculative_tokens`` of the recipe saved in checkpoint ``ckpt``
    (``recipe.yaml``), the K the draft was trained and measured for; ``default`` without one.

    Raises:
        ExportError: the saved recipe does not load (names the file).
    """
    from ..recipe import RecipeError, load_recipe

    path = ckpt / "recipe.yaml"
    if not path.is_file():
        return default
    if (ckpt / DRAFT_CONFIG_FILE).is_file():
        read_draft(ckpt, weights=False)  # a checkpoint of an older draftsmith: one line saying so, not its recipe's errors
    try:
        return load_recipe(path).eval.num_speculative_tokens
    except (RecipeError, ValueError, OSError) as exc:
        raise ExportError(f"{path}: the checkpoint's recipe does not load ({exc}); pass --num-speculative-tokens")


def resolve_checkpoint(path: Path) -> Path:
    """A checkpoint dir as is, or the latest ``checkpoints/step-N`` of a run dir.

    Raises:
        ExportError: neither; the message names the missing ``draft_config.json`` (and says
            when ``path`` is an export, or a checkpoint without its draft config).
    """
    if (path / DRAFT_CONFIG_FILE).is_file():
        return path
    ckpts = find_checkpoints(RunLayout(path).checkpoints)
    if ckpts:
        return ckpts[-1]
    missing = path / DRAFT_CONFIG_FILE
    if (path / "config.json").is_file() and (path / WEIGHTS_FILE).is_file():
        raise ExportError(f"{missing} missing: {path} is an exported draft (config.json), not a training "
                          "checkpoint; pass the RUN_DIR/checkpoints/step-N it was exported from")
    held = [name for name in (WEIGHTS_FILE, "train_state.json") if (path / name).is_file()]
    if held:
        raise ExportError(f"{missing} missing: {path} holds {' and '.join(held)} but no draft config, so it is not a "
                          "complete draftsmith training checkpoint; pass another RUN_DIR/checkpoints/step-N, or the "
                          "RUN_DIR (its latest complete checkpoint)")
    raise ExportError(f"{path}: neither a checkpoint nor a run directory with checkpoints (no {DRAFT_CONFIG_FILE}, "
                      f"no {RunLayout(path).checkpoints.name}/step-N); pass RUN_DIR/checkpoints/step-N or the RUN_DIR "
                      "of `draftsmith train`")
