"""The HTTP front's limits on size, time and connections, and its outermost guard.

gRPC caps a message at 4 MiB and closes idle connections itself; uvicorn, left as
it is, took a 100 MB body into memory (the coordinator's RSS grew ~500 MB), held a
body sent a byte a second for as long as the client liked, and kept connections
whose headers never ended open for good. Here:

- `Guard`, an ASGI middleware in front of the app: the bearer token, then the
  body read whole before the app sees it, refused past `max_body_bytes` (413,
  without buffering it: a declared length is refused at once, a chunked body as
  it passes the limit, and the rest is read and dropped so the client hears the
  answer) or when it takes longer than `body_timeout_s` (408), and no more than
  BODIES_HELD bodies' worth held at once (503); any exception the
  app lets out becomes a 500 in OpenAI's shape with an error id, never a traceback.
- `LimitedH11`, uvicorn's h11 protocol with a deadline for each request's headers
  (`header_timeout_s`, from the connection's start or the last response: 408 and
  closed) and a cap on open connections (`max_connections`: 503 and closed);
  HTTP it cannot parse gets OpenAI's 400 instead of uvicorn's plain text.

Every refusal here says `connection: close`: the body it did not read is not
taken for the next request.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging

import anyio
import grpc
from uvicorn.protocols.http.h11_impl import H11Protocol

from specdec.rpc.errors import report_internal

from coordinator.openai_api import error_body, error_dict
from coordinator.settings import HttpLimits

log = logging.getLogger("coordinator.http")
BODIES_HELD = 32   # the front holds at most this many largest bodies' worth at once


def error_response(status: int, kind: str, message: str, param: str | None = None) -> bytes:
    """A whole HTTP/1.1 response in OpenAI's error shape, for answers written before
    (or instead of) the app: the connection closes after it."""
    body = json.dumps(error_dict(message, kind, kind, param)).encode()
    phrase = {400: "Bad Request", 408: "Request Timeout", 413: "Content Too Large",
              503: "Service Unavailable"}.get(status, "Error")
    return (f"HTTP/1.1 {status} {phrase}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode() + body


async def send_json(send, status: int, body: dict, close: bool = False) -> None:
    raw = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": raw})


class Guard:
    """ASGI middleware: auth, the body's limits, and the last word on errors."""

    def __init__(self, app, limits: HttpLimits, auth_token: str | None = None) -> None:
        self.app, self.limits, self.auth_token = app, limits, auth_token
        # Bodies held at once, read or being read, until their requests end: bounded, so a
        # thousand connections each sending its 4 MiB cannot take 4 GB (503 past it).
        self.budget, self.buffered = BODIES_HELD * limits.max_body_bytes, 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracked(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)
        try:
            await self._guarded(scope, receive, tracked)
        except Exception as exc:   # the app's own handlers answer everything they expect
            message = report_internal(exc, f"{scope['method']} {scope['path']}", "coordinator", log)[1]
            if not started:
                await send_json(send, *error_body(grpc.StatusCode.INTERNAL, message), close=True)

    async def _guarded(self, scope, receive, send) -> None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.auth_token and scope["path"].startswith("/v1/"):
            given = headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.auth_token}".encode()):
                return await send_json(send, *error_body(
                    grpc.StatusCode.UNAUTHENTICATED,
                    "missing or wrong bearer token: send 'Authorization: Bearer <token>'"))
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        body = await self._body(headers, receive, send)
        if body is None:
            return
        replayed = False

        async def replay():
            """The body once, then what the connection says (a disconnect: the client left)."""
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()
        try:
            await self.app(scope, replay, send)
        finally:
            self.buffered -= len(body)

    async def _body(self, headers: dict, receive, send) -> bytes | None:
        """The whole body, or None once the client has been answered (or has left)."""
        limit = self.limits.max_body_bytes

        def too_large(size: str) -> dict:
            return error_dict(f"the request body ({size}) is over this server's limit of {limit:,} bytes "
                              "(--http-max-body-bytes)", "invalid_request_error", "request_too_large")
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            await self._drain(receive)
            await send_json(send, 413, too_large(f"{int(declared):,} bytes"), close=True)
            return None
        chunks, size, whole, refusal = [], 0, False, None
        try:
            with anyio.fail_after(self.limits.body_timeout_s):
                while refusal is None:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return None
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    self.buffered += len(chunk)
                    if size > limit:
                        refusal = 413, too_large(f"over {limit:,} bytes, sent in chunks")
                    elif self.buffered > self.budget:
                        refusal = error_body(grpc.StatusCode.UNAVAILABLE, f"this server holds {self.budget:,} bytes "
                                             "of request bodies at once, its limit; retry shortly")
                    elif not message.get("more_body", False):
                        chunks.append(chunk)
                        whole = True
                        return b"".join(chunks)
                    else:
                        chunks.append(chunk)
        except TimeoutError:
            await send_json(send, 408, error_dict(f"the request body did not arrive within "
                                                  f"{self.limits.body_timeout_s:g} s (--http-body-timeout)",
                                                  "invalid_request_error", "request_timeout"), close=True)
            return None
        finally:
            if not whole:   # else released once the app is done with it (_guarded)
                self.buffered -= size
        chunks.clear()
        if refusal[0] == 413:   # the client hears it rather than a reset; nothing more is held
            await self._drain(receive)
        await send_json(send, *refusal, close=True)
        return None

    async def _drain(self, receive) -> None:
        """Read and drop what is left of a refused body, so the client, still sending,
        hears the 413 instead of a reset; for at most the body's time limit."""
        with anyio.move_on_after(self.limits.body_timeout_s):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect" or not message.get("more_body", False):
                    return


class LimitedH11(H11Protocol):
    """uvicorn's h11 protocol with a deadline for headers and a cap on connections;
    `limits` is set on a subclass made per server (`protocol_for`)."""
    limits: HttpLimits = HttpLimits()

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        if len(self.connections) > self.limits.max_connections:
            log.warning("HTTP connections at the limit (%d, --http-max-connections): one refused",
                        self.limits.max_connections)
            transport.write(error_response(503, "service_unavailable",
                                           f"this server holds {self.limits.max_connections} connections, its limit "
                                           "(--http-max-connections); retry shortly"))
            transport.close()
            return
        self._arm()

    def _arm(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.limits.header_timeout_s, self._headers_late)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _waiting_for_headers(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def data_received(self, data: bytes) -> None:
        if self._waiting_for_headers():
            self._arm()      # a kept-alive connection's next request: its headers are timed too
        super().data_received(data)
        if not self._waiting_for_headers():
            self._disarm()

    def _headers_late(self) -> None:
        """No request's headers within the deadline (none, or a byte at a time): 408, closed.
        An idle kept-alive connection is uvicorn's (closed after keep_alive_s): the deadline
        starts again with the next request's first byte (data_received)."""
        self._header_timer = None
        if self._waiting_for_headers() and not self.transport.is_closing():
            self.transport.write(error_response(
                408, "request_timeout", f"the request's headers did not arrive within "
                f"{self.limits.header_timeout_s:g} s (--http-header-timeout)"))
            self.transport.close()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        self.transport.write(error_response(400, "invalid_request_error",
                                            f"invalid HTTP: {msg.rstrip('.')}; send HTTP/1.1 with headers "
                                            "under 16 KiB"))
        self.transport.close()


def protocol_for(limits: HttpLimits) -> type[LimitedH11]:
    return type("LimitedH11", (LimitedH11,), {"limits": limits})
