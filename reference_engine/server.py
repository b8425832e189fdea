"""OpenAI-compatible HTTP server over the engine: POST /v1/completions and /v1/chat/completions,
GET /v1/models, /health, /stats. Every error body is OpenAI-style JSON (unknown routes and oversized bodies
too); a request naming another model than the served one gets 404. A streamed request gets one SSE event per
engine output (its text may be empty while a character is incomplete), then a usage event if asked for, then
[DONE].

The engine runs on its own thread; each request's outputs arrive through the engine's on_output callback (on
that thread) and cross into asyncio with loop.call_soon_threadsafe onto the request's queue. The socket is
bound first (a busy port fails at once, before the model loads); /health answers 503 while loading and 200
once ready. SIGTERM/SIGINT: refuse new requests, let in-flight ones finish for up to `drain_timeout` seconds,
abort the rest, stop the engine, exit 0. A client that disconnects (streaming or not) cancels its handler,
which aborts the request, and the engine frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from reference_engine import chat, protocol
from reference_engine.config import Config
from reference_engine.protocol import CompletionRequest, RequestError

logger = logging.getLogger("reference_engine.server")
ABORT_GRACE_S = 3.0  # after aborting leftovers, how long handlers get to send their last chunk
MAX_BODY_BYTES = 16 * 1024 * 1024


@dataclass
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    queue_limit: int | None = None  # requests waiting beyond max_num_seqs; None: unlimited
    drain_timeout: float = 30.0
    warmup: bool = True
    model_name: str | None = None


@dataclass
class ActiveRequest:
    request: CompletionRequest
    outputs: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: bool = False


class StartupError(Exception):
    """The server could not start (one-line message)."""


@dataclass(frozen=True)
class Endpoint:
    """What differs between /v1/completions and /v1/chat/completions: parsing and the response bodies."""

    parse: Callable[[CompletionServer, dict], CompletionRequest]
    body: Callable[..., dict]  # (req, model, text=, finish_reason=, completion_tokens=): the whole answer
    chunk: Callable[..., dict]  # (req, model, text=, finish_reason=, first=): one streamed event
    usage_chunk: Callable[[CompletionRequest, str, int], dict]


COMPLETIONS = Endpoint(
    parse=lambda server, body: protocol.parse_completion_request(
        body, encode=server.engine.tokenizer.encode, vocab_size=server.config.vocab_size,
        max_model_len=server.config.max_model_len),
    body=protocol.completion_body,
    chunk=lambda req, model, *, text, finish_reason, first: protocol.completion_body(
        req, model, text=text, finish_reason=finish_reason),
    usage_chunk=protocol.usage_chunk,
)
CHAT = Endpoint(
    parse=lambda server, body: chat.parse_chat_request(
        body, template=server.chat_template, encode=server.engine.tokenizer.encode,
        max_model_len=server.config.max_model_len),
    body=chat.chat_body,
    chunk=chat.chat_chunk,
    usage_chunk=chat.chat_usage_chunk,
)


class CompletionServer:
    def __init__(self, config: Config, options: ServeOptions) -> None:
        self.config = config
        self.options = options
        self.model_name = options.model_name or (Path(config.model).name if config.model else config.preset)
        self.state = "loading"  # loading | ready | draining
        self.engine = None
        self.chat_template: chat.ChatTemplate | None = None
        self.active: dict[str, ActiveRequest] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._stop_requested = False

    # ---- lifecycle
    def request_stop(self) -> None:
        """Thread- and signal-safe: begin the graceful shutdown."""
        self._stop_requested = True
        if self.loop is not None and self._stop is not None:
            try:
                self.loop.call_soon_threadsafe(self._stop.set)
            except RuntimeError:  # loop already closed
                pass

    async def serve(self, *, started: float) -> None:
        self.loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        if self._stop_requested:
            self._stop.set()
        runner = web.AppRunner(self.build_app(), handle_signals=False, access_log=None,
                               handler_cancellation=True, shutdown_timeout=ABORT_GRACE_S)
        await runner.setup()
        try:
            await web.TCPSite(runner, self.options.host, self.options.port).start()
        except OSError as exc:
            await runner.cleanup()
            reason = exc.strerror.lower() if exc.strerror else str(exc)
            where = f"{self.options.host}:{self.options.port}"
            raise StartupError(f"cannot listen on {where}: {reason}") from None
        try:
            await self._load(started)
            await self._stop.wait()
            await self._drain()
        finally:
            await runner.cleanup()
            if self.engine is not None:
                await asyncio.to_thread(self.engine.shutdown)
                logger.info("stopped; engine stats: %s", json.dumps(self.engine.stats.as_dict()))

    async def _load(self, started: float) -> None:
        from reference_engine.engine import Engine, SamplingParams

        cfg = self.config
        logger.info("loading %s on %s: graph=%s kernels=%s async_scheduling=%s", self.model_name, cfg.device,
                    cfg.graph, cfg.kernels, cfg.async_scheduling)
        try:
            self.chat_template = chat.ChatTemplate.for_model(cfg.model)
        except (ValueError, OSError) as exc:
            raise StartupError(f"cannot load the chat template: {exc}") from None
        try:
            self.engine = await asyncio.to_thread(Engine, cfg)
        except Exception as exc:  # any load failure is one line, not a traceback
            raise StartupError(f"cannot load the model: {type(exc).__name__}: {exc}") from None
        self.engine.start()
        logger.info("engine: %s; chat template: %s", self.engine.describe(), self.chat_template.source)
        if self.options.warmup and not self._stop.is_set():
            # Compiles kernels and captures the batch-1 graphs before the first real request (on the engine
            # thread, like any request).
            warm = time.perf_counter()
            params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
            await asyncio.to_thread(self.engine.generate, [[1, 2, 3, 4]], params)
            logger.info("warmup: %.2f s", time.perf_counter() - warm)
        captured = [str(k) for k in self.engine.graphs.captured_keys]
        logger.info("captured graphs: %s", ", ".join(captured) if captured else "none")
        self.state = "ready"
        logger.info("ready: serving %s on http://%s:%d (%.1f s to ready)", self.model_name, self.options.host,
                    self.options.port, time.perf_counter() - started)

    async def _drain(self) -> None:
        self.state = "draining"
        if self.active:
            logger.info("draining %d request(s), up to %.0f s", len(self.active), self.options.drain_timeout)
        deadline = time.monotonic() + self.options.drain_timeout
        while self.active and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if self.active:
            logger.info("aborting %d request(s) still running", len(self.active))
            for request_id in list(self.active):
                self.engine.abort(request_id)
            deadline = time.monotonic() + ABORT_GRACE_S
            while self.active and time.monotonic() < deadline:
                await asyncio.sleep(0.02)

    # ---- HTTP
    def build_app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[json_errors])
        app.router.add_get("/health", self.health)
        app.router.add_get("/stats", self.stats)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        return app

    def _engine_alive(self) -> bool:
        thread = getattr(self.engine, "_thread", None)
        return isinstance(thread, threading.Thread) and thread.is_alive()

    def _usage(self) -> dict:
        info = {"status": self.state, "model": self.model_name, "in_flight": len(self.active)}
        if self.engine is not None:
            scheduler = self.engine.scheduler
            blocks = scheduler.blocks
            info.update(kv_blocks_total=blocks.num_usable, kv_blocks_used=blocks.num_usable - blocks.num_free,
                        running=len(scheduler.running), waiting=len(scheduler.waiting))
        return info

    async def health(self, request: web.Request) -> web.Response:
        info = self._usage()
        healthy = self.state == "ready" and self._engine_alive()
        if self.state == "ready" and not healthy:
            info["status"] = "engine stopped"
        return web.json_response(info, status=200 if healthy else 503)

    async def stats(self, request: web.Request) -> web.Response:
        info = self._usage()
        if self.engine is not None:
            info["engine"] = self.engine.stats.as_dict()
            info["captured_graphs"] = [str(k) for k in self.engine.graphs.captured_keys]
        return web.json_response(info)

    async def models(self, request: web.Request) -> web.Response:
        if self.state == "loading":
            return _unavailable("the model is loading")
        card = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "reference_engine",
                "max_model_len": self.config.max_model_len}
        return web.json_response({"object": "list", "data": [card]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, COMPLETIONS)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, CHAT)

    async def _generate(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        if self.state != "ready":
            loading = self.state == "loading"
            return _unavailable("the model is loading" if loading else "the server is shutting down")
        cfg = self.config
        try:
            body = protocol.parse_json(await request.read())
            protocol.check_model(body, self.model_name)
            req = endpoint.parse(self, body)
        except RequestError as err:
            return web.json_response(err.body(), status=err.status)
        limit = self.options.queue_limit
        if limit is not None and len(self.active) >= cfg.max_num_seqs + limit:
            message = (f"server overloaded: {len(self.active)} requests in flight (max_num_seqs "
                       f"{cfg.max_num_seqs} + queue limit {limit}); retry later")
            body = protocol.error_body(message, error_type="server_error", code="overloaded")
            return web.json_response(body, status=503)
        active = ActiveRequest(req)
        try:
            self._submit(active)
        except ValueError as exc:
            return web.json_response(protocol.error_body(str(exc), error_type="invalid_request_error"),
                                     status=400)
        self.active[req.id] = active
        try:
            if req.stream:
                return await self._stream(request, active, endpoint)
            return await self._complete(active, endpoint)
        except ConnectionError:  # the client went away mid-stream
            return web.Response(status=499)
        finally:
            self.active.pop(req.id, None)
            if not active.finished:  # disconnect (handler cancelled or write failed): free its blocks now
                self.engine.abort(req.id)

    def _submit(self, active: ActiveRequest) -> None:
        from reference_engine.engine import SamplingParams

        req, loop = active.request, self.loop

        def on_output(new_ids: list[int], finished: bool, reason: str | None) -> None:  # engine thread
            try:
                loop.call_soon_threadsafe(active.outputs.put_nowait, (list(new_ids), finished, reason))
            except RuntimeError:  # the loop is closed: the server is gone
                pass

        params = SamplingParams(max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p,
                                top_k=req.top_k, ignore_eos=req.ignore_eos, seed=req.seed)
        self.engine.submit(req.prompt_ids, params, on_output=on_output, request_id=req.id)

    async def _complete(self, active: ActiveRequest, endpoint: Endpoint) -> web.Response:
        decoder = protocol.IncrementalDecoder(self.engine.tokenizer.decode)
        text = []
        while True:
            new_ids, finished, reason = await active.outputs.get()
            text.append(decoder.push(new_ids, final=finished))
            if finished:
                active.finished = True
                break
        if reason == "error":
            return web.json_response(_engine_error(), status=500)
        body = endpoint.body(active.request, self.model_name, text="".join(text), finish_reason=reason,
                             completion_tokens=len(decoder.ids))
        return web.json_response(body)

    async def _stream(self, request: web.Request, active: ActiveRequest, endpoint: Endpoint
                      ) -> web.StreamResponse:
        req = active.request
        headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        response = web.StreamResponse(headers=headers)
        await response.prepare(request)
        decoder = protocol.IncrementalDecoder(self.engine.tokenizer.decode)
        first = True
        while True:
            new_ids, finished, reason = await active.outputs.get()
            if not new_ids and not finished:
                continue
            # One event per engine output, also when its text is held back (an incomplete character): a
            # client times tokens by events.
            delta = decoder.push(new_ids, final=finished)
            if finished:
                active.finished = True
                if reason == "error":
                    await _send(response, _engine_error())
                    break
            await _send(response, endpoint.chunk(req, self.model_name, text=delta,
                                                 finish_reason=reason if finished else None, first=first))
            first = False
            if finished:
                break
        if req.include_usage:
            await _send(response, endpoint.usage_chunk(req, self.model_name, len(decoder.ids)))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


@web.middleware
async def json_errors(request: web.Request, handler) -> web.StreamResponse:
    """aiohttp's own 404 / 405 / 413 answers are plain text: give them OpenAI-style JSON bodies."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        if exc.status == 404:
            message, code = f"Invalid URL ({request.method} {request.path})", "not_found"
        elif exc.status == 413:
            message = f"request body too large: the limit is {MAX_BODY_BYTES // (1024 * 1024)} MiB"
            code = "request_too_large"
        elif exc.status == 405:
            message, code = f"method {request.method} is not allowed on {request.path}", "method_not_allowed"
        else:
            message, code = exc.reason, None
        headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        body = protocol.error_body(message, error_type="invalid_request_error", code=code)
        return web.json_response(body, status=exc.status, headers=headers)


async def _send(response: web.StreamResponse, event: dict) -> None:
    await response.write(b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n")


def _engine_error() -> dict:
    return protocol.error_body("the engine failed while generating", error_type="server_error",
                               code="engine_error")


def _unavailable(message: str) -> web.Response:
    return web.json_response(protocol.error_body(message, error_type="server_error", code="unavailable"),
                             status=503)


def run_server(config: Config, options: ServeOptions, *, started: float | None = None) -> int:
    """Serve until SIGTERM/SIGINT; returns the exit code. Startup failures: one line on stderr, code 1.

    `started`: perf_counter() at process start, for the time-to-ready log line.
    """
    started = time.perf_counter() if started is None else started
    server = CompletionServer(config, options)
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    def on_signal(signum: int, frame) -> None:
        if server._stop_requested:  # a second Ctrl-C / SIGTERM: stop waiting for the drain
            logger.error("second %s: exiting without draining", signal.Signals(signum).name)
            os._exit(1)
        server.request_stop()

    for sig in previous:
        signal.signal(sig, on_signal)
    try:
        asyncio.run(server.serve(started=started))
    except StartupError as exc:
        logger.error("%s", exc)
        return 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
