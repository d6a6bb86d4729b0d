"""``RUN_DIR/data/target.json``: the target a run's data was prepared for, as a typed object.

Written by the data stage's target stage (:func:`draftsmith.data_prep.prepare.stage_target`),
read by every later stage (the run-directory agreement check, training, ``draftsmith demo``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class TargetInfoError(ValueError):
    """``target.json`` holds a key of the wrong type; the message names the file."""


class TargetInfo(BaseModel):
    """``RUN_DIR/data/target.json``: the resolved target and the aux layer ids of the run.

    The target stage writes every field, in this order (:meth:`to_json`). Each is optional when
    read, and keys of other versions are kept (``extra="allow"``), so a ``target.json`` of an
    older draftsmith (without ``verifier`` / ``architectures`` / ``num_hidden_layers``) still
    reads; :meth:`to_dict` gives back the keys the file had, plus any assigned since.
    """

    model_config = ConfigDict(extra="allow")

    name_or_path: str | None = Field(None, description="target.name_or_path of the recipe (hub id, local "
                                                       "directory or embedded:NAME)")
    verifier: str | None = Field(None, description="the name an exported draft gives its verifier (the hub id "
                                                   "for an embedded target; draftsmith.target.verifier_name)")
    path: str | None = Field(None, description="the local checkpoint directory the name resolved to")
    architectures: list[str] | None = Field(None, description="the target config's architectures")
    num_hidden_layers: int | None = Field(None, description="decoder layers N of the target's text config")
    hidden_size: int | None = Field(None, description="hidden size H of the target's text config")
    vocab_size: int | None = Field(None, description="vocabulary size V of the target's text config")
    aux_layer_ids: list[int] | None = Field(None, description="the 3 aux layer ids (vLLM convention, "
                                                              "0 <= L < N), sorted")

    def to_dict(self) -> dict[str, Any]:
        """The fields that were read or set (declared ones in declaration order, then other keys)."""
        return self.model_dump(exclude_unset=True)

    def to_json(self) -> str:
        """The file's text: :meth:`to_dict` as JSON, indented by one space."""
        return json.dumps(self.to_dict(), indent=1)

    def write(self, path: Path) -> Path:
        """Write :meth:`to_json` to ``path`` (the data stage writes atomically through its own
        ``atomic_write_bytes``); returns ``path``."""
        path = Path(path)
        path.write_text(self.to_json())
        return path

    @classmethod
    def read(cls, path: Path) -> TargetInfo:
        """Read a ``target.json``.

        Raises:
            FileNotFoundError: no such file (the OS's message; callers that know what to run
                first check for the file themselves).
            json.JSONDecodeError: the file is not JSON.
            TargetInfoError: not a JSON object, or a key of the wrong type (one line naming the file).
        """
        path = Path(path)
        raw = json.loads(path.read_text())
        try:
            return cls.model_validate(raw)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or '(file)'}: {e['msg']}" for e in exc.errors())
            raise TargetInfoError(f"{path}: invalid target.json ({problems})") from None
