"""The HTTP front tried as a hostile but honest client would: does any input get a
5xx, an error not in OpenAI's shape, or no answer; is a field that changes the
output ever ignored; are no-op values taken; what do abandoned requests, a huge
body and half-open connections cost the coordinator.

    specdec up --pair tiny --http-port 8000 &
    python benchmarks/http_probe.py --url http://127.0.0.1:8000 [--json out.json]

Sections (all by default; pick with --only): `inputs` (each case on a new
connection, then all of them on one kept-alive connection), `abandon` (clients
that leave non-stream requests after 1 s), `body` (a 100 MB body against the
coordinator's RSS), `half-open` (connections that never finish their headers),
`slow-body` (a body sent a byte at a time).
"""
from __future__ import annotations

import argparse
import json
import socket
import threading
import time
from dataclasses import dataclass, field

import httpx
import psutil

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MESSAGES = [{"role": "user", "content": "Say hi."}]


@dataclass
class Case:
    name: str
    path: str
    body: object = None          # JSON, or bytes sent as they are
    expect: str = "4xx"          # "2xx": a no-op that must be taken; "4xx": refused
    method: str = "POST"
    headers: dict = field(default_factory=lambda: {"content-type": "application/json"})
    param: bool = False          # a 400 that must name the field (error.param)


def chat(**extra) -> dict:
    return {"messages": MESSAGES, "max_tokens": 2, "temperature": 0} | extra


def comp(**extra) -> dict:
    return {"prompt": "hi", "max_tokens": 2, "temperature": 0} | extra


def cases() -> list[Case]:
    out: list[Case] = []

    def both(name: str, expect: str = "4xx", param: bool = False, **extra) -> None:
        out.append(Case(f"chat {name}", CHAT, chat(**extra), expect, param=param))
        out.append(Case(f"completions {name}", COMPLETIONS, comp(**extra), expect, param=param))
    # 1. Numbers out of every proto field's range, and of the API's.
    for name, value in (("max_tokens", 2**31), ("max_tokens", 2**32), ("max_tokens", 2**64), ("max_tokens", -1),
                        ("seed", 2**64), ("seed", -1), ("top_k", 2**31), ("top_k", -2),
                        ("temperature", 1e308), ("temperature", -1), ("top_p", 2), ("n", 2**64),
                        ("frequency_penalty", 1e300), ("repetition_penalty", -1)):
        both(f"{name}={value}", param=True, **{name: value})
    out.append(Case("chat top_logprobs=2**32", CHAT, chat(logprobs=True, top_logprobs=2**32), param=True))
    out.append(Case("chat max_completion_tokens=2**40", CHAT, chat(max_completion_tokens=2**40), param=True))
    out.append(Case("completions logprobs=2**32", COMPLETIONS, comp(logprobs=2**32), param=True))
    both("speculation.gamma=2**32", param=True, speculation={"gamma": 2**32})
    both("speculation.gamma=-1", param=True, speculation={"gamma": -1})
    for prompt in ([-1], [2**32], [10**9], [[-1]], [1.5], [], [[]]):
        out.append(Case(f"completions prompt={prompt}", COMPLETIONS, comp(prompt=prompt), param=True))
    for raw in (b'{"prompt": "hi", "max_tokens": 2, "temperature": NaN}',
                b'{"prompt": "hi", "max_tokens": 2, "temperature": Infinity}',
                b'{"prompt": "hi", "max_tokens": 2, "top_p": -Infinity}',
                b'{"prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}"):
        out.append(Case(f"completions raw {raw[35:60]!r}", COMPLETIONS, raw))
    # 2. Strings that are not UTF-8 text (a lone surrogate), or too long to echo.
    lone = "\ud800"
    out.append(Case("chat content surrogate", CHAT, chat(messages=[{"role": "user", "content": lone}]), param=True))
    out.append(Case("chat role surrogate", CHAT, chat(messages=[{"role": lone, "content": "x"}]), param=True))
    out.append(Case("completions prompt surrogate", COMPLETIONS, comp(prompt=lone), param=True))
    both("stop surrogate", param=True, stop=[lone])
    both("cache_salt surrogate", param=True, cache_salt=lone)
    both("model surrogate", param=True, model=lone)
    both("speculation.sources surrogate", param=True, speculation={"sources": [lone]})
    out.append(Case("chat role of 1 MB", CHAT, chat(messages=[{"role": "r" * 2**20, "content": "x"}]), param=True))
    both("speculation.sources of 1 MB", param=True, speculation={"sources": ["s" * 2**20]})
    # 3. Wrong types.
    for name, value in (("stream", "yes"), ("stream", 1), ("ignore_eos", "no"), ("stop", 5), ("stop", [1]),
                        ("speculation", "on"), ("speculation", {"enabled": "yes"}), ("speculation", {"x": 1}),
                        ("stream_options", {"include_usage": "yes"}), ("max_tokens", "5"), ("max_tokens", 2.5)):
        both(f"{name}={value!r}", param=True, **{name: value})
    for messages in ("hi", [1], [{"role": 1, "content": "x"}], [{"role": "user", "content": 5}],
                     [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
                     [{"role": "user", "content": [{"type": "text", "text": 5}]}], [{"content": "x"}],
                     [{"role": "user", "content": "x", "tool_call_id": "1"}]):
        out.append(Case(f"chat messages={json.dumps(messages)[:48]}", CHAT, chat(messages=messages), param=True))
    out.append(Case("chat logprobs='true'", CHAT, chat(logprobs="true"), param=True))
    for body in ([], "a", None, 5):
        out.append(Case(f"chat body {body!r}", CHAT, body))
        out.append(Case(f"completions body {body!r}", COMPLETIONS, body))
    # 4. Fields that change the output and are not done: refused, naming them.
    for name, value in (("min_p", 0.1), ("stop_token_ids", list(range(512))), ("allowed_token_ids", [1, 2]),
                        ("min_tokens", 5), ("prompt_logprobs", 1), ("guided_decoding_backend", "xgrammar"),
                        ("bad_words", ["x"]), ("truncate_prompt_tokens", 4), ("include_stop_str_in_output", True),
                        ("skip_special_tokens", False), ("length_penalty", 2.0), ("use_beam_search", True),
                        ("best_of", 2), ("logit_bias", {"1": 5}),
                        ("tools", [{"type": "function", "function": {"name": "f"}}]), ("no_such_field", 1),
                        ("prediction", {"type": "content", "content": "x"})):
        both(f"{name} set", param=True, **{name: value})
    # Structured outputs that cannot be: refused, naming the field they came in.
    for name, value in (("guided_regex", "[a-"), ("guided_json", {"type": "strin"}), ("guided_choice", []),
                        ("guided_grammar", "start: foo"), ("structured_outputs", {"regex": "a", "backend": "x"}),
                        ("structured_outputs", {}), ("response_format", {"type": "json_schema"}),
                        ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": 5}}),
                        ("response_format", {"type": "yaml"})):
        both(f"{name}={json.dumps(value)[:40]}", param=True, **{name: value})
    both("two structured outputs", param=True, guided_regex="a", response_format={"type": "json_object"})
    out.append(Case("completions echo=true", COMPLETIONS, comp(echo=True), param=True))
    out.append(Case("completions suffix='x'", COMPLETIONS, comp(suffix="x"), param=True))
    # 5. No-op values: taken.
    for name, value in (("logit_bias", {}), ("user", "u"), ("n", 1), ("stream_options", None), ("min_p", 0.0),
                        ("stop_token_ids", []), ("best_of", 1), ("metadata", {}), ("store", False),
                        ("service_tier", "auto")):
        both(f"{name}={value!r} (no-op)", expect="2xx", **{name: value})
    # Structured outputs, each way of asking: taken.
    for name, value in (("guided_regex", "[a-d]{2}"), ("guided_json", {"type": "object"}), ("guided_choice", ["a", "b"]),
                        ("guided_grammar", "root ::= \"a\""), ("structured_outputs", {"regex": "a"}),
                        ("structured_outputs", {"choice": ["x", "y"]}), ("response_format", {"type": "json_object"}),
                        ("response_format", {"type": "json_schema", "json_schema": {
                            "name": "n", "strict": True, "schema": {"type": "object", "properties": {
                                "n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}}})):
        both(f"{name}={json.dumps(value)[:40]}", expect="2xx", **{name: value})
    for name, value in (("response_format", {"type": "text"}), ("tool_choice", "none"), ("tools", []),
                        ("parallel_tool_calls", False), ("modalities", ["text"])):
        out.append(Case(f"chat {name}={value!r} (no-op)", CHAT, chat(**{name: value}), "2xx"))
    developer = [{"role": "developer", "content": "Be brief."}, *MESSAGES]
    out.append(Case("chat role developer", CHAT, chat(messages=developer), "2xx"))
    out.append(Case("completions suffix='' (no-op)", COMPLETIONS, comp(suffix=""), "2xx"))
    out.append(Case("completions echo=false (no-op)", COMPLETIONS, comp(echo=False), "2xx"))
    # 6. The transport: bodies that are not JSON, paths and methods that are not served.
    nested = b"[" * 100_000 + b"]" * 100_000
    for name, raw in (("not UTF-8", b'{"prompt": "\xff\xfe", "max_tokens": 2}'), ("deep JSON", nested),
                      ("invalid JSON", b'{"prompt": '), ("empty", b""), ("trailing garbage", b'{"prompt": "hi"} x'),
                      ("BOM, no prompt", b"\xef\xbb\xbf{\"max_tokens\": 2}"),
                      ("deep object", b'{"prompt": "hi", "a": ' + nested + b"}")):
        out.append(Case(f"completions body {name}", COMPLETIONS, raw))
        out.append(Case(f"chat body {name}", CHAT, raw))
    out.append(Case("completions body BOM", COMPLETIONS, b'\xef\xbb\xbf{"prompt": "hi", "max_tokens": 2}', "2xx"))
    out.append(Case("completions text/plain", COMPLETIONS, json.dumps(comp()).encode(), "2xx",
                    headers={"content-type": "text/plain"}))
    out.append(Case("completions no content-type", COMPLETIONS, json.dumps(comp()).encode(), "2xx", headers={}))
    out.append(Case("completions form content-type, not JSON", COMPLETIONS, b"prompt=hi&max_tokens=2",
                    headers={"content-type": "application/x-www-form-urlencoded"}))
    out.append(Case("GET /v1/chat/completions", CHAT, None, method="GET"))
    out.append(Case("POST /v1/models", "/v1/models", {}, method="POST"))
    out.append(Case("POST /v1/nothing", "/v1/nothing", {}))
    out.append(Case("GET /nothing", "/nothing", None, method="GET"))
    out.append(Case("DELETE /v1/completions", COMPLETIONS, None, method="DELETE"))
    return out


def openai_shaped(response: httpx.Response) -> bool:
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return (isinstance(error, dict) and isinstance(error.get("message"), str) and isinstance(error.get("type"), str)
            and "param" in error and "code" in error)


def send(client: httpx.Client, url: str, case: Case) -> httpx.Response:
    content = case.body if isinstance(case.body, bytes) else None if case.body is None and case.method != "POST" \
        else json.dumps(case.body).encode()
    return client.request(case.method, url + case.path, content=content, headers=case.headers)


def judge(case: Case, response: httpx.Response | None) -> list[str]:
    """What is wrong with `response` for `case` ([] if nothing)."""
    if response is None:
        return ["no answer"]
    status = response.status_code
    faults = []
    if status >= 500:
        faults.append("5xx")
    if status >= 400 and not openai_shaped(response):
        faults.append("not OpenAI's shape")
    if case.expect == "2xx" and status >= 300:
        faults.append("no-op refused")
    if case.expect == "4xx" and status < 400:
        faults.append("accepted (ignored?)")
    if case.param and status == 400 and openai_shaped(response) and not response.json()["error"]["param"]:
        faults.append("param null")
    return faults


def probe_inputs(url: str) -> dict:
    all_cases = cases()
    rows = {}
    for mode in ("new connection each", "one kept-alive connection"):
        faults: dict[str, int] = {}
        examples: dict[str, list[str]] = {}
        keep = httpx.Client(timeout=30) if mode.startswith("one") else None
        try:
            for case in all_cases:
                client = keep or httpx.Client(timeout=30)
                try:
                    response = send(client, url, case)
                except httpx.HTTPError:
                    response = None
                    if keep is not None:   # the next case on a new kept-alive connection
                        keep.close()
                        keep = httpx.Client(timeout=30)
                finally:
                    if client is not keep:
                        client.close()
                for fault in judge(case, response):
                    faults[fault] = faults.get(fault, 0) + 1
                    examples.setdefault(fault, []).append(
                        f"{case.name} -> {response.status_code if response is not None else '-'}")
        finally:
            if keep is not None:
                keep.close()
        serving = httpx.post(url + COMPLETIONS, json=comp(), timeout=30).status_code == 200
        rows[mode] = {"cases": len(all_cases), "faults": faults, "examples": examples, "serving_after": serving}
    return rows


def coordinator_process(url: str) -> psutil.Process:
    port = httpx.URL(url).port
    for conn in psutil.net_connections("tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid:
            return psutil.Process(conn.pid)
    raise SystemExit(f"no process listens on port {port} (run as root to see other users' sockets)")


def probe_abandon(url: str, clients: int = 64, info=None) -> dict:
    """`clients` non-stream requests of 900 tokens, each client gone after 1 s; then,
    while they would still be generating, a fresh client's request."""
    request = comp(prompt="a tale", max_tokens=900, ignore_eos=True)

    def leave() -> None:
        try:
            httpx.post(url + COMPLETIONS, json=request, timeout=1.0)
        except httpx.HTTPError:
            pass
    threads = [threading.Thread(target=leave) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    left = time.monotonic()
    fresh = httpx.post(url + COMPLETIONS, json=comp(), timeout=60)   # as soon as they have gone
    freed_s = None
    if info is not None:
        while time.monotonic() - left < 60:
            if info() == 0:
                freed_s = time.monotonic() - left
                break
            time.sleep(0.01)
    return {"clients": clients, "sessions_freed_s": freed_s, "fresh_status": fresh.status_code}


def probe_body(url: str, mb: int = 100) -> dict:
    process = coordinator_process(url)
    before = process.memory_info().rss
    payload = b'{"prompt": "' + b"a" * (mb * 2**20) + b'", "max_tokens": 1}'
    started = time.monotonic()
    try:
        response = httpx.post(url + COMPLETIONS, content=payload, headers={"content-type": "application/json"},
                              timeout=120)
        status, shaped = response.status_code, openai_shaped(response)
    except httpx.HTTPError as exc:
        status, shaped = f"{type(exc).__name__}", False
    time.sleep(0.5)
    return {"mb": mb, "status": status, "openai_shape": shaped, "seconds": round(time.monotonic() - started, 2),
            "rss_growth_mb": round((process.memory_info().rss - before) / 2**20, 1)}


def probe_half_open(url: str, connections: int = 3000, wait_s: float = 60) -> dict:
    u = httpx.URL(url)
    process = coordinator_process(url)
    socks = []
    for _ in range(connections):
        s = socket.create_connection((u.host, u.port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")   # headers never finished
        socks.append(s)
    opened = time.monotonic()
    peak_fds = process.num_fds()
    for s in socks:
        s.setblocking(False)
    closed_at = None
    while time.monotonic() - opened < wait_s:
        alive = 0
        for s in socks:
            try:
                s.recv(65536, socket.MSG_PEEK)   # b"" (closed) or an answer: the server is done with it
            except BlockingIOError:
                alive += 1
            except OSError:
                continue
        if alive == 0:
            closed_at = time.monotonic() - opened
            break
        time.sleep(0.25)
    for s in socks:
        s.close()
    return {"connections": connections, "all_closed_s": None if closed_at is None else round(closed_at, 2),
            "coordinator_fds_peak": peak_fds}


def probe_slow_body(url: str, seconds: float = 40) -> dict:
    u = httpx.URL(url)
    body = json.dumps(comp()).encode()
    s = socket.create_connection((u.host, u.port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
              b"content-length: %d\r\n\r\n" % len(body))
    started = time.monotonic()
    answer = b""
    s.settimeout(1.0)
    for byte in body:
        try:
            s.sendall(bytes([byte]))
            chunk = s.recv(65536)
            if chunk:
                answer += chunk
                break
            break   # closed
        except socket.timeout:
            pass
        except OSError:
            break
        if time.monotonic() - started > seconds:
            break
    s.close()
    status = answer.split(b" ", 2)[1].decode() if answer.startswith(b"HTTP/") else "-"
    return {"held_s": round(time.monotonic() - started, 1), "status": status}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--only", default="inputs,abandon,body,half-open,slow-body")
    parser.add_argument("--verifier", help="the verifier's gRPC address, to count its sessions (abandon)")
    parser.add_argument("--json")
    args = parser.parse_args()
    only = set(args.only.split(","))
    report = {}
    info = None
    if args.verifier:
        from specdec.rpc.serving import channel
        from specdec.v1 import common_pb2, verifier_pb2_grpc

        def info() -> int:
            with channel(args.verifier) as ch:
                return verifier_pb2_grpc.VerifierStub(ch).Info(common_pb2.InfoRequest(), timeout=10).active_sessions
    if "inputs" in only:
        report["inputs"] = probe_inputs(args.url)
        for mode, row in report["inputs"].items():
            print(f"| {mode} | {row['cases']} | " + ", ".join(f"{k}: {v}" for k, v in row["faults"].items())
                  + f" | serving after: {row['serving_after']} |")
            for fault, names in row["examples"].items():
                print(f"    {fault}: " + "; ".join(names[:40]))
    if "abandon" in only:
        report["abandon"] = probe_abandon(args.url, info=info)
        print("abandon:", report["abandon"])
    if "body" in only:
        report["body"] = probe_body(args.url)
        print("body:", report["body"])
    if "half-open" in only:
        report["half_open"] = probe_half_open(args.url)
        print("half-open:", report["half_open"])
    if "slow-body" in only:
        report["slow_body"] = probe_slow_body(args.url)
        print("slow-body:", report["slow_body"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
