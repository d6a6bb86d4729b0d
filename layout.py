"""Where every stage reads and writes: the run directory layout and the files passed between
stages, as typed objects.

    RUN_DIR/
      recipe.yaml           resolved recipe (data_prep/prepare.py, train/)
      data/                 :class:`DataPaths`: target.json, regen.jsonl, tokenized.jsonl,
                            stats.json, vocab.safetensors, hidden_states/, summary.json
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
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

if TYPE_CHECKING:
    import torch

DRAFT_CONFIG_FILE = "draft_config.json"


@dataclass
class DataPaths:
    """The files of ``RUN_DIR/data`` (written by ``data_prep/prepare.py``, read by ``train/``)."""

    root: Path

    @property
    def target_info(self) -> Path:
        """``target.json``: the resolved target (path, hidden_size, vocab_size, aux_layer_ids ...)."""
        return self.root / "target.json"

    @property
    def regen(self) -> Path:
        """``regen.jsonl``: cached target replies (regenerate stage)."""
        return self.root / "regen.jsonl"

    @property
    def tokenized(self) -> Path:
        """``tokenized.jsonl``: ``{id, input_ids, loss_mask}`` per sequence."""
        return self.root / "tokenized.jsonl"

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


def read_tokenized(paths: DataPaths) -> list[dict]:
    """The rows of ``tokenized.jsonl``: ``{"id", "input_ids", "loss_mask"}`` each.

    Raises:
        FileNotFoundError: the tokenize stage has not run.
    """
    if not paths.tokenized.is_file():
        raise FileNotFoundError(f"{paths.tokenized} missing: run the tokenize stage first")
    with paths.tokenized.open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


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


class DraftConfigError(ValueError):
    """``draft_config.json`` is missing or invalid; the message names the file."""


class DraftCheckpointConfig(BaseModel):
    """``draft_config.json`` of a training checkpoint: what export needs besides the weights.

    Written by every training method's ``checkpoint_extras``, read by ``eval/export.py``,
    ``eval/export_heads.py`` and ``eval/compare_drafts.py``. Unset optional fields are not
    written, so the file keeps the keys (and bytes) of checkpoints written before this class.
    """

    model_config = ConfigDict(extra="forbid")

    method: str = Field(description="draft method (draftsmith.methods name): eagle3, medusa, mlp_speculator")
    config: dict[str, Any] = Field(description="the draft model config's fields (its to_dict())")
    target: dict[str, Any] = Field(description="RUN_DIR/data/target.json of the run (name_or_path, "
                                               "verifier, path, architectures, hidden_size, vocab_size ...)")
    ttt_steps: int | None = Field(None, description="EAGLE-3: train.ttt_steps trained with")
    head_decay: float | None = Field(None, description="Medusa / MLP speculator: train.head_decay trained with")

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
            DraftConfigError: the file is missing, not JSON, or has missing / unknown / mistyped keys.
        """
        path = Path(directory) / DRAFT_CONFIG_FILE
        if not path.is_file():
            raise DraftConfigError(f"{path} missing: not a draftsmith training checkpoint")
        try:
            return cls.model_validate_json(path.read_text())
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or '(file)'}: {e['msg']}" for e in exc.errors())
            raise DraftConfigError(f"{path}: invalid draft config ({problems})") from None
