"""specdec load: N concurrent clients against the whole stack, over gRPC or the HTTP front.

    specdec load --pair tiny --clients 1,4,16,32 --requests 64
    specdec load --pair smollm2-self --clients 1,4,8 --requests 16 --max-new-tokens 32
    specdec load --address HOST:PORT ...          # a stack that is already running
    specdec load --pair qwen-coder --clients 1,8,32 --per-client 2 --systems spec-auto,target-only
    specdec load --pair tiny --clients 1 --api both --stream --requests 64   # HTTP's overhead against gRPC's
    specdec load --pair tiny --clients 32 --api http --stream --duration 120 --drop-every 10

For each client count it sends a fixed number of requests (a mix of greedy and
sampled, fixed length) and reports latency p50/p99, throughput, and errors by
status code. When it starts the stack itself it also reads each service's RSS:
after a warm-up at the highest concurrency, and again after the whole run, so a
leak (sessions, KV caches) shows as growth. Requests refused with
RESOURCE_EXHAUSTED (admission control, --max-sessions) are counted apart from
errors. `--systems` runs each level once per system, interleaved: spec-auto
(adaptive γ, the default) and target-only (speculation off) on the same stack,
and each of them `-cold`: every request with a cache_salt of its own, so the
model services' prefix caches find nothing (the cache off, side by side).
`--system-prompt-tokens N` puts the same system prompt of about N tokens before
every request's question (agents, RAG front-ends): what prefix caching is for.
Per level it also sums what the responses' stats say: tokens drafted and
accepted, requests that drafted at all, and the verifier's batching (rows per
forward its calls shared, their queue waits). Prints a table and writes load.json.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import json
import pathlib
import statistics
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field

import grpc
import httpx
import psutil

from specdec_tools import launcher
from specdec_tools.load_clients import APIS, HttpError, Target, sessions_left
from specdec.weights.pairs import PAIRS
from specdec.rpc.security import ClientTls, load_token
from specdec.v1 import common_pb2, coordinator_pb2 as pb

PROMPTS = [
    "Write a function that returns the sum of two numbers.",
    "Explain what a hash table is in two sentences.",
    "The weather today is sunny and",
    "def fibonacci(n):",
    "List three uses of a binary search tree.",
    "Once upon a time there was",
    "Translate 'good morning' into French and German.",
    "What is the capital of France?",
]


COLD = "-cold"  # a system's requests each with their own cache salt: no prefix-cache hits
SYSTEMS = ("spec-auto", "target-only", "spec-auto" + COLD, "target-only" + COLD)
SYSTEM_PROMPT_SENTENCES = [
    "You are a careful assistant for a software company's internal tools.",
    "Answer in plain language, cite the document section you rely on, and say so when you are unsure.",
    "Never invent function names, flags or version numbers that the documents do not contain.",
    "Prefer short answers with one example over long ones without.",
    "The documents below describe the build system, the deployment pipeline and the on-call runbook.",
]


def system_prompt(tokens: int) -> str:
    """About `tokens` tokens of a fixed system prompt (some 4 characters a token), the same every call."""
    words, parts = 0, []
    i = 0
    while words * 4 // 3 < tokens:  # about 4/3 tokens an English word
        sentence = f"{i + 1}. {SYSTEM_PROMPT_SENTENCES[i % len(SYSTEM_PROMPT_SENTENCES)]}"
        parts.append(sentence)
        words += len(sentence.split())
        i += 1
    return "\n".join(parts)


@dataclass
class Level:
    clients: int
    requests: int
    system: str = "spec-auto"
    api: str = "grpc"
    ok: int = 0
    dropped: int = 0                       # HTTP streams closed after their first chunk (--drop-every)
    first_token_p50_ms: float = 0.0        # --stream: the first text's arrival at the client, median
    refused: int = 0                       # RESOURCE_EXHAUSTED: admission control said no
    errors: dict[str, int] = field(default_factory=dict)  # any other status, by code
    error_examples: list[str] = field(default_factory=list)
    latency_p50_s: float = 0.0
    latency_p99_s: float = 0.0
    latency_max_s: float = 0.0
    wall_s: float = 0.0
    output_tokens: int = 0
    tokens_per_s: float = 0.0
    requests_per_s: float = 0.0
    drafted_requests: int = 0              # requests that drafted at least one token
    # Every numeric GenerationStats field (specdec.v1), summed over the level's requests.
    stats: dict[str, float] = field(default_factory=dict)
    greedy_outputs: dict[int, list[int]] = field(default_factory=dict)  # prompt index -> token ids (T = 0)
    greedy_same: int = -1                  # of those compared, equal to the first level's for the same prompt
    greedy_compared: int = 0               # greedy prompts the first level has too

    def add(self, stats: pb.GenerationStats) -> None:
        self.drafted_requests += stats.draft_tokens > 0
        for descriptor, value in stats.ListFields():
            if isinstance(value, (int, float)) and not isinstance(value, bool):  # not lists, messages, flags
                self.stats[descriptor.name] = self.stats.get(descriptor.name, 0) + value

    def total(self, name: str) -> float:
        assert name in pb.GenerationStats.DESCRIPTOR.fields_by_name, name
        return self.stats.get(name, 0)

    def mean(self, name: str) -> float:
        """A GenerationStats field's mean over the level's answered requests."""
        return self.total(name) / self.ok if self.ok else 0.0

    @property
    def acceptance(self) -> float:
        drafted = self.total("draft_tokens")
        return self.total("accepted_tokens") / drafted if drafted else 0.0


def make_request(i: int, max_new_tokens: int, ignore_eos: bool, system: str = "spec-auto",
                 shared_prompt: str = "") -> pb.GenerateRequest:
    sampling = common_pb2.SamplingParams(temperature=0.0 if i % 2 == 0 else 0.7)
    request = pb.GenerateRequest(max_new_tokens=max_new_tokens, ignore_eos=ignore_eos, sampling=sampling)
    if shared_prompt:
        request.messages.messages.add(role="system", content=shared_prompt)
        request.messages.messages.add(role="user", content=PROMPTS[i % len(PROMPTS)])
    else:
        request.prompt = PROMPTS[i % len(PROMPTS)]
    if system.startswith("target-only"):
        request.speculation.enabled = False
    if system.endswith(COLD):
        request.cache_salt = uuid.uuid4().hex
    return request


def run_level(target: Target, clients: int, requests: int, args: argparse.Namespace,
              system: str = "spec-auto", api: str = "grpc") -> Level:
    """`requests` requests from `clients` clients at once (or, with --duration, as many as
    they send in that time), through `api`."""
    level = Level(clients, requests, system, api)
    latencies: list[float] = []
    firsts: list[float] = []
    lock = threading.Lock()
    counter = iter(range(requests)) if not args.duration else itertools.count()
    until = time.perf_counter() + args.duration if args.duration else None
    connections = [target.client(api) for _ in range(clients)]  # one connection per client

    def client(index: int) -> None:
        conn = connections[index]
        while True:
            with lock:
                i = next(counter, None)
            if i is None or (until is not None and time.perf_counter() >= until):
                return
            drop = api == "http" and args.stream and args.drop_every > 0 and i % args.drop_every == args.drop_every - 1
            started = time.perf_counter()
            try:
                answer = conn.generate(make_request(i, args.max_new_tokens, not args.stop_at_eos, system,
                                                    args.shared_prompt), args.timeout, args.stream, drop)
            except (grpc.RpcError, HttpError, httpx.HTTPError, ValueError) as exc:
                code = exc.code().name if isinstance(exc, grpc.RpcError) else \
                    f"HTTP {exc.status}" if isinstance(exc, HttpError) else type(exc).__name__
                with lock:
                    if code in ("RESOURCE_EXHAUSTED", "HTTP 429"):
                        level.refused += 1
                    else:
                        level.errors[code] = level.errors.get(code, 0) + 1
                        if len(level.error_examples) < 5:
                            level.error_examples.append(exc.details() if isinstance(exc, grpc.RpcError) else str(exc))
                continue
            with lock:
                if answer.dropped:
                    level.dropped += 1
                    continue
                latencies.append(time.perf_counter() - started)
                if answer.first_token_s:
                    firsts.append(answer.first_token_s * 1e3)
                level.ok += 1
                level.output_tokens += len(answer.token_ids)
                if i % 2 == 0 and api == "grpc":  # greedy (make_request): batching may only change it through roundings
                    level.greedy_outputs.setdefault(i % len(PROMPTS), list(answer.token_ids))
                level.add(answer.stats)

    started = time.perf_counter()
    try:
        with concurrent.futures.ThreadPoolExecutor(clients) as pool:
            list(pool.map(client, range(clients)))
    finally:
        for conn in connections:
            conn.close()
    level.wall_s = time.perf_counter() - started
    level.requests = level.ok + level.refused + level.dropped + sum(level.errors.values())
    level.latency_p50_s = statistics.median(latencies) if latencies else 0.0
    if len(latencies) >= 2:
        level.latency_p99_s = statistics.quantiles(latencies, n=100, method="inclusive")[98]
    else:
        level.latency_p99_s = level.latency_p50_s
    level.latency_max_s = max(latencies, default=0.0)
    level.first_token_p50_ms = statistics.median(firsts) if firsts else 0.0
    level.tokens_per_s = level.output_tokens / level.wall_s
    level.requests_per_s = level.ok / level.wall_s
    return level


def rss_mib(children: list[launcher.Child]) -> dict[str, float]:
    return {c.name: psutil.Process(c.process.pid).memory_info().rss / 2**20 for c in children}


def compare_greedy(levels: list[Level]) -> None:
    """How often a greedy output under load equals the same prompt's at the first
    level (bf16 and int4 sums depend on a batch's rows; fp32 ones barely do)."""
    first = {}
    for lv in levels:
        if lv.api != "grpc":   # HTTP answers carry text, not ids
            continue
        reference = first.setdefault(lv.system, lv.greedy_outputs)
        if lv.greedy_outputs is not reference:
            shared = [k for k in lv.greedy_outputs if k in reference]
            lv.greedy_compared = len(shared)
            lv.greedy_same = sum(reference[k] == lv.greedy_outputs[k] for k in shared)


def cached_share(level: Level, name: str) -> str:
    prompt = level.total("prompt_tokens")
    return f"{level.total(name) / prompt:.0%}" if prompt else "-"


def print_table(levels: list[Level], rss: dict) -> None:
    print("| system | api | clients | requests | ok | refused | dropped | errors | p50 s | p99 s | max s | tok/s | "
          "x 1 client | req/s | drafted reqs | acceptance | verify rows/fwd | verify queue s/req | "
          "greedy as at first level | prompt tokens | prefix-cached (target, draft) | first token ms | "
          "first token ms at the client |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    alone = {(lv.system, lv.api): lv.tokens_per_s for lv in levels if lv.clients == 1}
    for lv in levels:
        errors = sum(lv.errors.values())
        ratio = f"{lv.tokens_per_s / alone[lv.system, lv.api]:.2f}" if alone.get((lv.system, lv.api)) else "-"
        print(f"| {lv.system} | {lv.api} | {lv.clients} | {lv.requests} | {lv.ok} | {lv.refused} | {lv.dropped} | "
              f"{errors} | "
              f"{lv.latency_p50_s:.3f} | {lv.latency_p99_s:.3f} | {lv.latency_max_s:.3f} | {lv.tokens_per_s:.1f} | "
              f"{ratio} | {lv.requests_per_s:.2f} | {lv.drafted_requests} | {lv.acceptance:.2f} | "
              f"{lv.mean('verify_batch_rows'):.1f} | {lv.mean('verify_queue_ms') / 1e3:.2f} | "
              f"{f'{lv.greedy_same}/{lv.greedy_compared}' if lv.greedy_same >= 0 else '-'} | "
              f"{lv.mean('prompt_tokens'):.0f} | {cached_share(lv, 'prefix_cached_tokens')}, "
              f"{cached_share(lv, 'draft_prefix_cached_tokens')} | {lv.mean('first_token_ms'):.0f} | "
              f"{f'{lv.first_token_p50_ms:.1f}' if lv.first_token_p50_ms else '-'} |")
        for example in lv.error_examples:
            print(f"  error: {example}")
    if rss:
        print("\n| service | RSS before MiB | RSS after MiB | growth MiB | growth % |")
        print("|---|---|---|---|---|")
        for name, before in rss["before"].items():
            after = rss["after"][name]
            print(f"| {name} | {before:.0f} | {after:.0f} | {after - before:+.1f} | {100 * (after - before) / before:+.1f}% |")
        if "sessions_left" in rss:
            print("\nsessions open in the model services after the run: " +
                  ", ".join(f"{name} {n}" for name, n in rss["sessions_left"].items()))


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="specdec load", description=__doc__.split("\n\n")[0])
    p.add_argument("--address", help="a running coordinator (default: start --pair on loopback)")
    p.add_argument("--http-address", help="... and its OpenAI-compatible front, HOST:PORT (for --api http)")
    p.add_argument("--api", default="grpc", choices=(*APIS, "both"),
                   help="gRPC Generate, the OpenAI-compatible HTTP front, or both interleaved at each level")
    p.add_argument("--stream", action="store_true",
                   help="streaming calls (GenerateStream; stream: true): the first token's time at the client")
    p.add_argument("--duration", type=float, default=0.0,
                   help="seconds each level runs, its clients sending requests back to back (0: --requests)")
    p.add_argument("--drop-every", type=int, default=0,
                   help="with --api http --stream: every Nth request's client closes its connection after the "
                        "first chunk (counted as dropped; its sessions must be freed)")
    p.add_argument("--pair", default="tiny", choices=sorted(PAIRS))
    p.add_argument("--clients", default="1,4,16,32", help="comma-separated concurrency levels (1..256)")
    p.add_argument("--requests", type=int, default=64, help="requests per level")
    p.add_argument("--per-client", type=int, default=0,
                   help="requests per client at each level instead of --requests (a level of N clients sends N x this)")
    p.add_argument("--min-requests", type=int, default=0, help="with --per-client: at least this many a level")
    p.add_argument("--systems", default="spec-auto",
                   help=f"comma-separated, run interleaved at each level: {', '.join(SYSTEMS)}")
    p.add_argument("--warmup", type=int, default=-1,
                   help="requests at the highest concurrency before the levels (default: that many clients)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--system-prompt-tokens", type=int, default=0,
                   help="the same system prompt of about N tokens before every question (0: none)")
    p.add_argument("--stop-at-eos", action="store_true", help="let requests end at EOS (default: fixed length)")
    p.add_argument("--max-sessions", type=int, help="the coordinator's admission limit, when this starts it")
    p.add_argument("--threads", type=int, default=0, help="torch threads per model service, when this starts them")
    p.add_argument("--timeout", type=float, default=300.0, help="per-request deadline in seconds")
    p.add_argument("--tls-ca", help="CA of a TLS coordinator (--address)")
    p.add_argument("--auth-token-env", metavar="VAR", help="bearer token from this environment variable")
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("load_out"))
    args = p.parse_args(argv)
    args.levels = [int(x) for x in args.clients.split(",")]
    if not all(1 <= n <= 256 for n in args.levels):
        p.error("--clients takes counts between 1 and 256")
    args.shared_prompt = system_prompt(args.system_prompt_tokens) if args.system_prompt_tokens > 0 else ""
    args.system_list = [x for x in args.systems.split(",") if x]
    args.api_list = list(APIS) if args.api == "both" else [args.api]
    unknown = [x for x in args.system_list if x not in SYSTEMS]
    if unknown or not args.system_list:
        p.error(f"--systems takes {', '.join(SYSTEMS)}; got {args.systems!r}")
    return args


def level_requests(args: argparse.Namespace, clients: int) -> int:
    return max(args.per_client * clients, args.min_requests) if args.per_client > 0 else args.requests


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    tls = ClientTls(ca=args.tls_ca) if args.tls_ca else None
    token = load_token(env=args.auth_token_env)
    stack: launcher.Stack | None = None
    children: list[launcher.Child] = []
    try:
        target = Target(args.address, f"http://{args.http_address}/v1" if args.http_address else None, tls, token)
        if args.address is None:
            extra = ["--max-sessions", str(args.max_sessions)] if args.max_sessions else []
            options = launcher.StackOptions.for_pair(PAIRS[args.pair], port=0, threads=args.threads,
                                                     coordinator_args=(*extra, "--http-port", "0"))
            launcher.pull_models([options.draft_model, options.target_model])
            stack = launcher.Stack(options)
            children = stack.children
            coordinator = stack.launch()
            stack.settle(say=lambda line: print(f"specdec load: {line}", flush=True))
            target.address, target.http_url = coordinator.address, f"http://127.0.0.1:{coordinator.http_port}/v1"
        print(f"specdec load: warming up against {target.address}", flush=True)
        warmup = max(args.levels) if args.warmup < 0 else args.warmup
        if warmup:
            for api in args.api_list:
                run_level(target, max(args.levels), warmup, argparse.Namespace(**{**vars(args), "duration": 0}),
                          api=api)
        rss = {"before": rss_mib(children)} if children else {}
        levels = []
        for clients in args.levels:
            for system in args.system_list:
                for api in args.api_list:
                    level = run_level(target, clients, level_requests(args, clients), args, system, api)
                    levels.append(level)
                    print(f"specdec load: {system} ({api}), {clients} clients: {level.ok} ok, {level.refused} "
                          f"refused, {level.dropped} dropped, {sum(level.errors.values())} errors, p50 "
                          f"{level.latency_p50_s:.3f} s, p99 {level.latency_p99_s:.3f} s, {level.tokens_per_s:.1f} "
                          f"tok/s", flush=True)
        if children:
            rss["after"] = rss_mib(children)
            rss["sessions_left"] = sessions_left(stack)
            dead = [c.name for c in children if c.process.poll() is not None]
        else:
            dead = []
    except launcher.LaunchError as exc:
        print(f"specdec load: {exc}", file=sys.stderr)
        return 2
    finally:
        if stack is not None:
            stack.stop()
    print()
    compare_greedy(levels)
    print_table(levels, rss)
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"address": args.address, "pair": None if args.address else args.pair,
              "max_new_tokens": args.max_new_tokens, "fixed_length": not args.stop_at_eos,
              "levels": [{**asdict(lv), "acceptance": lv.acceptance,
                          "mean_stats": {name: lv.mean(name) for name in lv.stats}} for lv in levels], "rss_mib": rss,
              "systems": args.system_list,
              "exited_early": dead}
    (args.out / "load.json").write_text(json.dumps(report, indent=2))
    print(f"\nwrote {args.out / 'load.json'}")
    failed = sum(sum(lv.errors.values()) for lv in levels) or dead or any(rss.get("sessions_left", {}).values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
