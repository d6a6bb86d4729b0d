"""Where every stage reads and writes: the run directory layout and the files passed between
stages, as typed objects.

    RUN_DIR/
      recipe.yaml           resolved recipe (data_prep/prepare.py, train/)
      data/                 :class:`DataPaths`: target.json, regen.jsonl, tokenized/ (Arrow),
                            stats.json, vocab.safetensors, hidden_states/, summary.json,
                            spec.json (the recipe keys the data was prepared with)
      checkpoints/step-N/   model, optimizer, ..., draft_config.json (:class:`DraftCheckpointConfig`)
      export/               eval/export.py output (vLLM-loadable draft)
      eval/                 acceptance and serving results
      logs/
      metrics.jsonl         one JSON object per logged step

Data flows one way (``data_prep/`` -> ``train/`` -> ``eval/``); each stage takes its paths from
here rather than from the stage that wrote them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from . import __version__

if TYPE_CHECKING:
    import torch

DRAFT_CONFIG_FILE = "draft_config.json"
OLDEST_READABLE = (0, 2, 0)
"""Checkpoints of an earlier draftsmith are refused with one line, not read: 0.2.0 dropped the
code that converted older layouts (recipe keys, checkpoint files, the tokenised data)."""
C = TypeVar("C")  # a parsed export config (read_export)


@dataclass
class DataPaths:
    """The files of ``RUN_DIR/data`` (written by ``data_prep/prepare.py``, read by ``train/``)."""

    root: Path

    @property
    def target_info(self) -> Path:
        """``target.json``: the resolved target (path, hidden_size, vocab_size, aux_layer_ids ...;
        read and written as :class:`draftsmith.target.TargetInfo`)."""
        return self.root / "target.json"

    @property
    def regen(self) -> Path:
        """``regen.jsonl``: cached target replies (regenerate stage)."""
        return self.root / "regen.jsonl"

    @property
    def tokenized(self) -> Path:
        """``tokenized/``: a ``datasets`` Arrow dataset (``save_to_disk``), one row per sequence with
        columns ``id`` (str), ``input_ids`` (int32 list), ``loss_mask`` (int8 list), ``length`` (int).
        Read memory-mapped with :func:`read_tokenized`."""
        return self.root / "tokenized"

    @property
    def tokenized_done(self) -> Path:
        """``tokenized/state.json``: present once the dataset is complete (it is renamed into place
        as a whole, so a killed write leaves only a ``.tokenized.tmp-*`` directory)."""
        return self.tokenized / "state.json"

    @property
    def vocab(self) -> Path:
        """``vocab.safetensors``: draft vocab ``d2t int64 [Vd]`` and ``t2d bool [V]``."""
        return self.root / "vocab.safetensors"

    @property
    def hidden_states(self) -> Path:
        """``hidden_states/``: sharded aux + final target hidden states and their manifest."""
        return self.root / "hidden_states"

    @property
    def stats(self) -> Path:
        """``stats.json``: tokenize-stage counts."""
        return self.root / "stats.json"

    @property
    def summary(self) -> Path:
        """``summary.json``: timings of the last prepare run."""
        return self.root / "summary.json"

    @property
    def spec(self) -> Path:
        """``spec.json``: per stage, the recipe keys its output was prepared with
        (:mod:`draftsmith.data_prep.agreement`: a recipe that disagrees is refused before
        anything is written)."""
        return self.root / "spec.json"


@dataclass(frozen=True)
class RunLayout:
    """The paths of one run directory, shared by data preparation, training and evaluation."""

    run_dir: Path

    @property
    def data(self) -> DataPaths:
        return DataPaths(self.run_dir / "data")

    @property
    def recipe(self) -> Path:
        return self.run_dir / "recipe.yaml"

    @property
    def checkpoints(self) -> Path:
        return self.run_dir / "checkpoints"

    @property
    def export(self) -> Path:
        return self.run_dir / "export"

    @property
    def eval(self) -> Path:
        return self.run_dir / "eval"

    @property
    def logs(self) -> Path:
        return self.run_dir / "logs"

    @property
    def metrics(self) -> Path:
        return self.run_dir / "metrics.jsonl"


TOKENIZED_TMP_PREFIX = ".tokenized.tmp-"


def tokenized_features():
    """The ``datasets.Features`` of the tokenised dataset (:attr:`DataPaths.tokenized`)."""
    import datasets

    return datasets.Features({
        "id": datasets.Value("string"),
        "input_ids": datasets.Sequence(datasets.Value("int32")),
        "loss_mask": datasets.Sequence(datasets.Value("int8")),
        "length": datasets.Value("int64"),
    })


def tokenized_temp_dir(paths: DataPaths) -> Path:
    """A fresh temporary directory next to :attr:`DataPaths.tokenized` (same file system, so the
    finished dataset is renamed into place)."""
    import tempfile

    paths.root.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=TOKENIZED_TMP_PREFIX, dir=paths.root))


def remove_stale_tokenized_temps(paths: DataPaths) -> None:
    """Remove the temporary directories of tokenised writes a killed run did not finish."""
    import shutil

    for stale in paths.root.glob(TOKENIZED_TMP_PREFIX + "*"):
        shutil.rmtree(stale, ignore_errors=True)


def save_tokenized(paths: DataPaths, dataset: Any, tmp: Path | None = None) -> None:
    """Write ``dataset`` (columns of :func:`tokenized_features`) to :attr:`DataPaths.tokenized`
    atomically: ``save_to_disk`` into a temporary directory, then rename it into place (an
    existing dataset is replaced). ``tmp``: the temporary directory to use (removed after)."""
    import shutil

    own_tmp = tmp is None
    tmp = tmp if tmp is not None else tokenized_temp_dir(paths)
    try:
        staged = tmp / "dataset"
        dataset.save_to_disk(str(staged))
        if paths.tokenized.exists():
            shutil.rmtree(paths.tokenized)
        staged.rename(paths.tokenized)
    finally:
        if own_tmp:
            shutil.rmtree(tmp, ignore_errors=True)


def write_tokenized_rows(paths: DataPaths, rows: Any) -> None:
    """Write an iterable of ``{"id", "input_ids", "loss_mask"}`` rows as the tokenised dataset
    (streamed through ``Dataset.from_generator``: the rows are never all in memory)."""
    import shutil
    import uuid

    import datasets

    tmp = tokenized_temp_dir(paths)
    try:
        def gen():
            for r in rows:
                yield {"id": str(r["id"]), "input_ids": r["input_ids"], "loss_mask": r["loss_mask"],
                       "length": len(r["input_ids"])}

        ds = datasets.Dataset.from_generator(gen, features=tokenized_features(), cache_dir=str(tmp / "cache"),
                                             fingerprint=uuid.uuid4().hex)
        save_tokenized(paths, ds, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def read_tokenized(paths: DataPaths, format: str | None = "numpy") -> Any:
    """The tokenised dataset, memory-mapped (``datasets.load_from_disk``): a ``datasets.Dataset``
    with columns ``id``, ``input_ids``, ``loss_mask``, ``length`` in ``format`` (``numpy``,
    ``torch``, ``arrow`` or None for Python objects). Rows are read from the Arrow files on
    access; nothing is loaded up front.

    Raises:
        FileNotFoundError: the tokenize stage has not run (one line; for a run prepared by
            draftsmith < 0.2.0, whose ``tokenized.jsonl`` this version does not read, it says to
            re-run prepare).
    """
    import datasets

    if not paths.tokenized_done.is_file():
        old = paths.root / "tokenized.jsonl"
        if old.is_file():
            raise FileNotFoundError(f"{old}: data prepared by draftsmith < 0.2.0, which this version does not read; "
                                    f"re-run prepare into {paths.root.parent} (draftsmith prepare RECIPE --run-dir ...)")
        raise FileNotFoundError(f"{paths.tokenized} missing: run the tokenize stage first")
    ds = datasets.load_from_disk(str(paths.tokenized))
    return ds.with_format(format) if format else ds


def read_vocab(paths: DataPaths) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d2t int64 [Vd], t2d bool [V])`` of the draft vocab.

    Raises:
        FileNotFoundError: the vocab stage has not run.
    """
    from safetensors.torch import load_file

    if not paths.vocab.is_file():
        raise FileNotFoundError(f"{paths.vocab} missing: run the vocab stage first")
    t = load_file(str(paths.vocab))
    return t["d2t"], t["t2d"]


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


def written_before_oldest_readable(version: Any) -> bool:
    """Whether ``version`` (the draftsmith version a file records; None or missing: one older
    than the stamp) is below :data:`OLDEST_READABLE`."""
    import re

    numbers = tuple(int(n) for n in re.findall(r"\d+", str(version or ""))[:3])
    return not numbers or numbers < OLDEST_READABLE


def too_old_message(what: Path, version: Any, remedy: str) -> str:
    """The one line that refuses ``what``, written by draftsmith ``version`` (None: before the
    version was recorded), naming the ``remedy``."""
    found = f"draftsmith {version}" if version else "a draftsmith before 0.2.0"
    return (f"{what}: written by {found}, which this draftsmith ({__version__}) no longer reads: {remedy}")


class DraftConfigError(ValueError):
    """``draft_config.json`` is missing or invalid; the message names the file."""


class DraftCheckpointConfig(BaseModel):
    """``draft_config.json`` of a training checkpoint: what export needs besides the weights.

    Written by every training method's ``checkpoint_extras``, read by
    :func:`draftsmith.train.checkpoint.read_draft` (export, warm start, compare). Unset optional
    fields are not written. ``version`` is the draftsmith that wrote it; :meth:`read` refuses one
    older than :data:`OLDEST_READABLE`.
    """

    model_config = ConfigDict(extra="forbid")

    method: str = Field(description="draft method: a name registered in draftsmith.methods (draftsmith.methods.registered_methods())")
    config: dict[str, Any] = Field(description="the draft model config's fields (its to_dict())")
    target: dict[str, Any] = Field(description="RUN_DIR/data/target.json of the run (name_or_path, "
                                               "verifier, path, architectures, hidden_size, vocab_size ...)")
    ttt_steps: int | None = Field(None, description="EAGLE-3: draft.ttt_steps trained with")
    head_decay: float | None = Field(None, description="Medusa / MLP speculator: draft.head_decay trained with")
    version: str = Field(__version__, description="draftsmith version that wrote the checkpoint")

    @property
    def verifier(self) -> str | None:
        """The target's hub id (``verifier``, else ``name_or_path``)."""
        return self.target.get("verifier", self.target.get("name_or_path"))

    def to_json(self) -> str:
        data = self.model_dump()
        return json.dumps({k: v for k, v in data.items() if v is not None or k in ("method", "config", "target")},
                          indent=1)

    def write(self, directory: Path) -> Path:
        """Write ``directory/draft_config.json``; returns its path."""
        path = Path(directory) / DRAFT_CONFIG_FILE
        path.write_text(self.to_json())
        return path

    @classmethod
    def read(cls, directory: Path) -> DraftCheckpointConfig:
        """Read ``directory/draft_config.json``.

        Raises:
            DraftConfigError: the file is missing, not JSON, has missing / unknown / mistyped keys,
                or was written by a draftsmith older than :data:`OLDEST_READABLE` (one line).
        """
        path = Path(directory) / DRAFT_CONFIG_FILE
        if not path.is_file():
            raise DraftConfigError(f"{path} missing: not a draftsmith training checkpoint")
        try:
            raw = json.loads(path.read_text())
            if isinstance(raw, dict) and written_before_oldest_readable(raw.get("version")):
                raise DraftConfigError(too_old_message(Path(directory), raw.get("version"), "re-export it with the "
                                                       "draftsmith that wrote it, or train again with this one"))
            return cls.model_validate(raw)
        except json.JSONDecodeError as exc:
            raise DraftConfigError(f"{path}: invalid draft config (not JSON: {exc})") from None
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or '(file)'}: {e['msg']}" for e in exc.errors())
            raise DraftConfigError(f"{path}: invalid draft config ({problems})") from None


@dataclass
class DraftCheckpoint:
    """A training checkpoint as :func:`draftsmith.train.checkpoint.read_draft` reads it.

    Attributes:
        path: the checkpoint directory (``checkpoints/step-N``).
        meta: its ``draft_config.json``.
        config: the method's model config built from ``meta.config`` (``Eagle3Config``, ...).
        state: the model's state dict, ``module.`` prefixes stripped (empty when read without weights).
    """

    path: Path
    meta: DraftCheckpointConfig
    config: Any
    state: dict[str, torch.Tensor]

    @property
    def method(self) -> str:
        return self.meta.method

    @property
    def weights(self) -> Path:
        return self.path / "model.safetensors"


class DraftLoadError(ValueError):
    """An exported draft folder is unreadable or does not fit the target; names the file / key."""


class ExportError(ValueError):
    """A training checkpoint is incomplete or inconsistent, or a tensor set is not the layout
    vLLM loads; the message names the file / key."""


def read_export_config(path: Path) -> dict[str, Any]:
    """``path/config.json`` of an exported draft folder.

    Raises:
        DraftLoadError: no ``config.json`` there.
    """
    f = path / "config.json"
    if not f.is_file():
        raise DraftLoadError(f"{f} missing: not an exported draft folder")
    return json.loads(f.read_text())


def read_export(path: Path, parse: Callable[[dict[str, Any]], C]) -> tuple[C, dict[str, torch.Tensor], Path]:
    """An export folder's ``config.json`` as ``parse`` reads it, and its weights.

    Returns:
        ``(config, tensors, weights path)``: floating tensors as float32, legacy ``midlayer.*``
        names as ``layers.0.*``.

    Raises:
        DraftLoadError: no ``config.json`` or ``model.safetensors``; a key ``parse`` misses or a
            value it refuses (``KeyError`` / ``TypeError`` / ``ValueError``), named with the file.
    """
    from safetensors.torch import load_file

    raw = read_export_config(path)
    try:
        config = parse(raw)
    except KeyError as exc:
        raise DraftLoadError(f"{path / 'config.json'}: missing key {exc}") from None
    except (TypeError, ValueError) as exc:
        raise DraftLoadError(f"{path / 'config.json'}: {exc}") from None
    weights = path / "model.safetensors"
    if not weights.is_file():
        raise DraftLoadError(f"{weights} missing")
    state = {k.replace("midlayer.", "layers.0."): v.float() if v.is_floating_point() else v
             for k, v in load_file(str(weights)).items()}
    return config, state, weights
