"""The OpenAI-compatible HTTP front: `POST /v1/chat/completions`,
`POST /v1/completions` (unary, or server-sent events with `stream: true`),
`GET /v1/models`, `GET /health`.

FastAPI on uvicorn, in a thread of the coordinator's process, calling the same
servicer as `Generate` (admission, limits, speculation, traces, metrics: all one
path). The servicer's calls are synchronous, so each request's generation runs
on a worker thread, one `next()` at a time; a client that disconnects, streaming
or not, is told to the engine, which stops within a round and ends both sessions.
A body is checked whole (coordinator.openai_schema) before anything reaches a
proto. Errors come in OpenAI's shape with the status `openai_api.HTTP_STATUS`
maps the gRPC code to, `param` naming the field at fault; the bearer token is the
gRPC API's. The limits on size, time and connections, and the last word on any
error, are coordinator.http_limits', in front of this app.
"""
from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import threading
import time
from typing import AsyncIterator, Iterator

import anyio
import grpc
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdec.rpc.errors import InvalidArgument, SpecdecError, Unavailable, clip, public_message, report_internal
from specdec.rpc.security import ServerTls

from coordinator.http_limits import Guard, protocol_for
from coordinator.openai_api import Reply, constraint_of, error_body, to_generate
from coordinator.openai_schema import ChatRequest, CompletionRequest, http_param, parse
from coordinator.requests import update_to_proto
from coordinator.settings import HttpLimits

log = logging.getLogger("coordinator.http")
FORWARDED_HEADERS = ("authorization", "traceparent", "tracestate")


class HttpCall:
    """What the servicer reads of a gRPC call's context, for an HTTP request: its
    headers (the bearer token: who called; W3C trace context), no deadline, and
    whether the client is still there."""

    def __init__(self, headers) -> None:
        self.metadata = tuple((k, v) for k, v in headers.items() if k.lower() in FORWARDED_HEADERS)
        self.gone = threading.Event()

    def invocation_metadata(self):
        return self.metadata

    def peer_identities(self):
        return None

    def time_remaining(self):
        return None

    def is_active(self) -> bool:
        return not self.gone.is_set()


def _error(exc: BaseException, body=None) -> JSONResponse:
    """Any failure as OpenAI's error; an unexpected one with an error id to report,
    its traceback in the log under it, never to the client. `body`: the request, once
    parsed (its structured output's field is what a constraint's error names)."""
    param = None
    if isinstance(exc, SpecdecError):
        asked = constraint_of(body) if body is not None and exc.param else None
        code, message, param = exc.code, str(exc), http_param(exc.param, asked[0] if asked else None)
    elif isinstance(exc, grpc.RpcError):
        code = exc.code()
        message = public_message("verifier", code, exc.details() or "")
    else:
        code, message = grpc.StatusCode.INTERNAL, report_internal(exc, "an HTTP request", "coordinator", log)[1]
    status, body = error_body(code, message, param)
    return JSONResponse(body, status_code=status)


def parse_body(raw: bytes, content_type: str, model: type):
    """The request body (read whole, and bounded, by http_limits.Guard) as `model`."""
    if not raw.strip():
        raise InvalidArgument("the request body is empty; send a JSON object (Content-Type: application/json)")
    try:
        data = json.loads(raw)
    except RecursionError:
        raise InvalidArgument("the request body nests deeper than this server reads") from None
    except ValueError as exc:   # JSONDecodeError, UnicodeDecodeError, a number of over 4300 digits
        sent_as = "" if "json" in content_type else \
            f" (sent as {clip(content_type or 'no Content-Type')}; send Content-Type: application/json)"
        raise InvalidArgument(f"the request body is not JSON: {clip(str(exc), 200)[1:-1]}{sent_as}") from None
    return parse(model, data)


def build_app(servicer, model: str, serving: threading.Event | None = None) -> FastAPI:
    """The HTTP front over `servicer` (a CoordinatorServicer), serving `model`. While
    `serving` is clear (the verifier down, or the coordinator draining after SIGTERM),
    new generations get 503 and /health says so; those under way go on. The bearer
    token and the limits are `http_limits.Guard`'s, in front of this app."""
    app = FastAPI(title="specdec", docs_url=None, redoc_url=None, openapi_url=None)
    if serving is None:
        serving = threading.Event()
        serving.set()
    tokenizer = servicer.backends.tokenizer
    limiter = anyio.CapacityLimiter(servicer.config.max_sessions + 8)   # as the gRPC server's workers

    def decode_token(token_id: int) -> str:
        return tokenizer.decode([token_id], skip_special_tokens=False)

    @app.exception_handler(StarletteHTTPException)
    async def not_served(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        missing = exc.status_code == 404
        what = "no such path" if missing else f"{request.method} is not served here"
        _, body = error_body(grpc.StatusCode.NOT_FOUND if missing else grpc.StatusCode.INVALID_ARGUMENT,
                             f"{what}: {request.method} {clip(request.url.path)[1:-1]}; this server serves POST "
                             "/v1/chat/completions, POST /v1/completions, GET /v1/models and GET /health")
        return JSONResponse(body, status_code=exc.status_code)

    @app.get("/health")
    async def health() -> JSONResponse:
        up = serving.is_set()
        return JSONResponse({"status": "ok" if up else "unavailable"}, status_code=200 if up else 503)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model, "object": "model", "created": int(time.time()),
                                            "owned_by": "specdec"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await _serve(request, ChatRequest)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _serve(request, CompletionRequest)

    async def _serve(request: Request, kind: type):
        try:
            body = parse_body(await request.body(), request.headers.get("content-type", ""), kind)
            if not serving.is_set():
                raise Unavailable("the coordinator is not serving (its verifier is down, or it is shutting down); "
                                  "retry shortly")
            generate = to_generate(body, model)
        except Exception as exc:
            return _error(exc)
        chat = kind is ChatRequest
        call = HttpCall(request.headers)
        step = _Stepper(servicer.updates(generate, call), limiter)
        reply = Reply(chat, model, decode_token)
        # From here the client may leave at any time, the prefill included: the watcher ends the generation.
        step.watcher = watcher = asyncio.create_task(_watch_disconnect(request.receive, call, step))  # held
        try:
            first = await step.next()   # admission, validation and the prefill: errors as statuses
        except BaseException as exc:
            watcher.cancel()
            await step.close()
            return _error(exc, body)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(_events(first, step, reply, call, include_usage, generate.logprobs),
                                     media_type="text/event-stream")
        try:
            return JSONResponse(await _whole(first, step, reply, generate.logprobs))
        except BaseException as exc:
            return _error(exc)
        finally:
            watcher.cancel()
            await step.close()

    return app


class _Stepper:
    """A synchronous generator of updates, advanced on worker threads, always in one
    context of its own: the request's trace span, opened in its first step, is the
    current one in every later step (each worker call would otherwise get a copy)."""

    def __init__(self, updates: Iterator, limiter: anyio.CapacityLimiter) -> None:
        self.updates, self.limiter = updates, limiter
        self.context = contextvars.copy_context()
        self.lock = asyncio.Lock()   # one step at a time; close waits for the step under way
        self.closed = False

    async def next(self):
        async with self.lock:
            if self.closed:
                return None
            return await anyio.to_thread.run_sync(self.context.run, next, self.updates, None, limiter=self.limiter)

    async def close(self) -> None:
        """End the generation (its sessions with it); idempotent. Shielded: a response
        cancelled because its client went still ends them."""
        with anyio.CancelScope(shield=True):
            async with self.lock:
                if not self.closed:
                    self.closed = True
                    await anyio.to_thread.run_sync(self.context.run, self.updates.close, limiter=self.limiter)


async def _watch_disconnect(receive, call: HttpCall, step: "_Stepper") -> None:
    """Until the response is done (then cancelled): the client gone tells the engine
    (it stops within a round) and ends the generation, its sessions with it. Waits on
    the connection itself (after the body, its next message is the disconnect), so a
    non-stream request's client that leaves is seen at once, not at the next poll."""
    while (await receive())["type"] != "http.disconnect":
        pass
    call.gone.set()
    await step.close()


async def _whole(first, step: _Stepper, reply: Reply, logprobs: bool) -> dict:
    text, tokens, entries, update = [], 0, [], first
    while update is not None:
        response = update_to_proto(update, with_stats=True)
        text.append(response.text)
        tokens += len(response.token_ids)
        entries += response.logprobs
        last = response
        update = await step.next() if update.delta.finish_reason is None else None
    return reply.whole("".join(text), tokens, last.finish_reason, last.stats, entries if logprobs else None)


async def _events(first, step: _Stepper, reply: Reply, call: HttpCall, include_usage: bool,
                  logprobs: bool) -> AsyncIterator[str]:
    def event(payload: dict) -> str:
        # ASCII, every other character escaped: a line splitter that also breaks at U+2028 or
        # U+0085 (Python's str.splitlines, as httpx's iter_lines uses) then keeps each event whole.
        return f"data: {json.dumps(payload)}\n\n"
    update, tokens, sent_first = first, 0, False
    try:
        while update is not None:
            response = update_to_proto(update, with_stats=update.delta.finish_reason is not None)
            tokens += len(response.token_ids)
            done = update.delta.finish_reason is not None
            if response.text or response.token_ids or not sent_first or done:
                yield event(reply.chunk(response.text, not sent_first, response.finish_reason if done else None,
                                        list(response.logprobs) if logprobs else None))
                sent_first = True
            if done:
                if include_usage:
                    yield event(reply.usage_chunk(response.stats, tokens))
                break
            update = await step.next()
    except (SpecdecError, grpc.RpcError) as exc:   # mid-stream: the error as an event, as vLLM sends it
        yield event(json.loads(_error(exc).body))
    except BaseException:
        call.gone.set()   # the client went (the response was cancelled): stop within a round
        raise
    finally:
        await step.close()
    yield "data: [DONE]\n\n"


class HttpFront:
    """uvicorn serving the app on a thread of its own, until `stop`, behind the
    limits' guard and protocol (coordinator.http_limits)."""

    def __init__(self, app: FastAPI, host: str, port: int, tls: ServerTls | None = None,
                 limits: HttpLimits = HttpLimits(), auth_token: str | None = None) -> None:
        config = uvicorn.Config(Guard(app, limits, auth_token), host=host, port=port, log_level="warning",
                                access_log=False, timeout_graceful_shutdown=5, lifespan="off",
                                http=protocol_for(limits), timeout_keep_alive=limits.keep_alive_s,
                                ssl_certfile=tls.cert if tls else None, ssl_keyfile=tls.key if tls else None)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="http-front", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise OSError(f"the HTTP front could not listen on {host}:{port}")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
