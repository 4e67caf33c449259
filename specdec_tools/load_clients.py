"""The two APIs `specdec load` drives, behind one call: a GenerateRequest sent over
gRPC (`Generate`, or `GenerateStream` with --stream) or as the same request through
the OpenAI-compatible HTTP front (`/v1/completions` or `/v1/chat/completions`,
with `stream: true` under --stream). Either way the answer is its token count, the
services' GenerationStats, and, streaming, when the first text arrived at the
client. A `drop` request (HTTP, streaming) closes its connection after the first
chunk, as a client that goes away does: its sessions must be freed."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass

import httpx
from google.protobuf.json_format import ParseDict

from specdec.rpc.serving import channel
from specdec.v1 import coordinator_pb2 as pb, coordinator_pb2_grpc
from specdec_tools import launcher

APIS = ("grpc", "http")


@dataclass
class Answer:
    token_ids: list[int]             # over HTTP: the count only ([0] * n), texts are not ids
    stats: pb.GenerationStats
    first_token_s: float = 0.0       # streaming: from the call to the first text, at the client
    dropped: bool = False            # the client went away after the first chunk (as asked)


class GrpcClient:
    def __init__(self, address: str, tls=None, token: str | None = None) -> None:
        self.channel = channel(address, tls, token)
        self.stub = coordinator_pb2_grpc.CoordinatorStub(self.channel)

    def generate(self, request: pb.GenerateRequest, timeout: float, stream: bool, drop: bool = False) -> Answer:
        started = time.perf_counter()
        if not stream:
            reply = self.stub.Generate(request, timeout=timeout)
            return Answer(list(reply.token_ids), reply.stats)
        ids, first, stats = [], 0.0, pb.GenerationStats()
        for message in self.stub.GenerateStream(request, timeout=timeout):
            if message.token_ids and not first:
                first = time.perf_counter() - started
            ids += message.token_ids
            if message.HasField("stats"):
                stats = message.stats
        return Answer(ids, stats, first)

    def close(self) -> None:
        self.channel.close()


class HttpError(Exception):
    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:200]}")
        self.status = status


def openai_body(request: pb.GenerateRequest) -> tuple[str, dict]:
    """The path and JSON body that ask the HTTP front for what `request` asks."""
    body: dict = {"max_tokens": request.max_new_tokens, "temperature": request.sampling.temperature,
                  "ignore_eos": request.ignore_eos}
    if request.cache_salt:
        body["cache_salt"] = request.cache_salt
    if request.HasField("speculation") and request.speculation.HasField("enabled"):
        body["speculation"] = {"enabled": request.speculation.enabled}
    if request.WhichOneof("input") == "messages":
        body["messages"] = [{"role": m.role, "content": m.content} for m in request.messages.messages]
        return "/chat/completions", body
    body["prompt"] = request.prompt
    return "/completions", body


class HttpClient:
    def __init__(self, base_url: str, token: str | None = None) -> None:
        headers = {"authorization": f"Bearer {token}"} if token else {}
        self.client = httpx.Client(base_url=base_url, headers=headers)   # one keep-alive connection

    def generate(self, request: pb.GenerateRequest, timeout: float, stream: bool, drop: bool = False) -> Answer:
        path, body = openai_body(request)
        started = time.perf_counter()
        if not stream:
            reply = self.client.post(path, json=body, timeout=timeout)
            if reply.status_code != 200:
                raise HttpError(reply.status_code, reply.text)
            data = reply.json()
            return Answer([0] * data["usage"]["completion_tokens"], ParseDict(data["specdec"], pb.GenerationStats()))
        tokens, first, stats = 0, 0.0, pb.GenerationStats()
        with self.client.stream("POST", path, json=body | {"stream": True,
                                                           "stream_options": {"include_usage": True}},
                                timeout=timeout) as reply:
            if reply.status_code != 200:
                raise HttpError(reply.status_code, reply.read().decode())
            for line in reply.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    raise HttpError(500, json.dumps(event["error"]))
                if event.get("choices") and not first:
                    first = time.perf_counter() - started
                    if drop:
                        return Answer([], stats, first, dropped=True)   # leaving the block closes it
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
                    stats = ParseDict(event["specdec"], pb.GenerationStats())
        return Answer([0] * tokens, stats, first)

    def close(self) -> None:
        self.client.close()


@dataclass
class Target:
    """Where the clients go: the coordinator's gRPC address, and its HTTP front's base URL."""
    address: str
    http_url: str | None
    tls: object = None
    token: str | None = None

    def client(self, api: str):
        if api == "http":
            if self.http_url is None:
                raise SystemExit("specdec load: --api http needs the coordinator's HTTP front (--http-address)")
            return HttpClient(self.http_url, self.token)
        return GrpcClient(self.address, self.tls, self.token)


def sessions_left(stack: launcher.Stack, within_s: float = 5.0) -> dict[str, int]:
    """Each model service's open sessions (Info.active_sessions) after the run, once
    none is left or `within_s` has passed: a client that went away in the last
    round is noticed within a poll and its generation ends within a round, but a
    session it left open would still be open by then."""
    deadline = time.monotonic() + within_s
    while True:
        out = {name: stack.info(name).active_sessions for name in ("drafter", "verifier")}
        if not any(out.values()) or time.monotonic() >= deadline:
            return out
        time.sleep(0.05)
