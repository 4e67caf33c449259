"""The `specdec` command: `up` starts the three services, `generate` calls them."""
from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import grpc
from google.protobuf import json_format

from specdec.models import DEFAULT_PAIR, PAIRS
from specdec.serving import channel
from specdec.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc


@dataclass
class Child:
    name: str
    process: subprocess.Popen
    address: str = ""


def _spawn(name: str, module: str, args: list[str], ready_timeout_s: float) -> Child:
    """Start `python -m module` and wait for its 'NAME SERVING on HOST:PORT' line."""
    process = subprocess.Popen([sys.executable, "-u", "-m", module, *args], stdout=subprocess.PIPE, text=True)
    child = Child(name, process)
    found = threading.Event()

    def read() -> None:
        for line in process.stdout:  # keep draining, so a chatty child never blocks
            if not found.is_set() and " SERVING on " in line:
                child.address = line.split(" SERVING on ", 1)[1].split()[0]
                found.set()

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + ready_timeout_s
    while not found.wait(0.1):
        if process.poll() is not None:
            raise SystemExit(f"specdec up: {name} exited with code {process.returncode} before serving")
        if time.monotonic() > deadline:
            process.terminate()
            raise SystemExit(f"specdec up: {name} not serving after {ready_timeout_s:.0f} s")
    return child


def _stop(children: list[Child], grace_s: float = 15.0) -> None:
    for child in reversed(children):
        if child.process.poll() is None:
            child.process.send_signal(signal.SIGTERM)
    for child in reversed(children):
        try:
            child.process.wait(grace_s)
        except subprocess.TimeoutExpired:
            child.process.kill()


def cmd_up(args: argparse.Namespace) -> int:
    pair = PAIRS[args.pair]
    draft_model = args.draft_model or pair.draft
    target_model = args.target_model or pair.target
    common = ["--device", args.device, "--host", "127.0.0.1", "--port", "0"]
    children: list[Child] = []
    stopping = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.set())
    try:
        # Both models load at once; the coordinator checks them once both serve.
        drafter = _spawn("drafter", "drafter", ["--model", draft_model, "--dtype", pair.draft_dtype,
                                                "--quantize", args.draft_quantize or pair.draft_quantize, *common],
                         args.ready_timeout)
        children.append(drafter)
        verifier = _spawn("verifier", "verifier", ["--model", target_model, "--dtype", pair.target_dtype, *common],
                          args.ready_timeout)
        children.append(verifier)
        coordinator = _spawn("coordinator", "coordinator", [
            "--drafter", drafter.address, "--verifier", verifier.address, "--host", args.host,
            "--port", str(args.port), "--gamma", str(args.gamma)], args.ready_timeout)
        children.append(coordinator)
        print(f"specdec up: coordinator on {coordinator.address} (draft {draft_model}, target {target_model}); "
              "Ctrl-C stops all three", flush=True)
        while not stopping.wait(0.5):
            exited = next((c for c in children if c.process.poll() is not None), None)
            if exited:
                print(f"specdec up: {exited.name} exited with code {exited.process.returncode}; stopping",
                      file=sys.stderr, flush=True)
                return 1
        return 0
    except SystemExit as exc:
        print(exc, file=sys.stderr, flush=True)
        return 2
    finally:
        _stop(children)


def build_request(args: argparse.Namespace) -> coordinator_pb2.GenerateRequest:
    request = coordinator_pb2.GenerateRequest(stop=args.stop or [])
    if args.messages is not None:
        messages = json.loads(args.messages)
        request.messages.messages.extend(coordinator_pb2.ChatMessage(role=m["role"], content=m["content"])
                                         for m in messages)
    else:
        request.prompt = args.prompt
    if args.max_new_tokens is not None:
        request.max_new_tokens = args.max_new_tokens
    sampling = common_pb2.SamplingParams(temperature=args.temperature, top_k=args.top_k)
    if args.top_p is not None:
        sampling.top_p = args.top_p
    if args.repetition_penalty is not None:
        sampling.repetition_penalty = args.repetition_penalty
    if args.seed is not None:
        sampling.seed = args.seed
    request.sampling.CopyFrom(sampling)
    if args.no_speculation:
        request.speculation.enabled = False
    request.speculation.gamma = args.gamma or 0
    return request


def cmd_generate(args: argparse.Namespace) -> int:
    request = build_request(args)
    with channel(args.addr) as ch:
        stub = coordinator_pb2_grpc.CoordinatorStub(ch)
        try:
            if not args.stream:
                response = stub.Generate(request, timeout=args.timeout)
            else:
                response = coordinator_pb2.GenerateResponse()
                for message in stub.GenerateStream(request, timeout=args.timeout):
                    if not args.json:
                        print(message.text, end="", flush=True)
                    response.text += message.text
                    response.token_ids.extend(message.token_ids)
                    if message.HasField("stats"):
                        response.finish_reason = message.finish_reason
                        response.stats.CopyFrom(message.stats)
                if not args.json:
                    print()
        except grpc.RpcError as exc:
            print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    if args.json:
        print(json_format.MessageToJson(response, always_print_fields_with_no_presence=True))
    elif not args.stream:
        print(response.text)
    return 0


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="specdec", description="speculative decoding over gRPC")
    sub = root.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start drafter, verifier and coordinator on loopback")
    up.add_argument("--pair", default=DEFAULT_PAIR, choices=sorted(PAIRS))
    up.add_argument("--draft-model", help="overrides the pair's draft model")
    up.add_argument("--target-model", help="overrides the pair's target model")
    up.add_argument("--draft-quantize", choices=["none", "int8"], help="overrides the pair's setting")
    up.add_argument("--gamma", type=int, default=4)
    up.add_argument("--host", default="127.0.0.1", help="coordinator bind address")
    up.add_argument("--port", type=int, default=50051, help="coordinator port")
    up.add_argument("--device", default="cpu", help="cpu or cuda")
    up.add_argument("--ready-timeout", type=float, default=900.0, help="seconds to wait for each service")
    up.set_defaults(func=cmd_up)

    gen = sub.add_parser("generate", help="call Generate on a running coordinator")
    gen.add_argument("--addr", default="127.0.0.1:50051")
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt")
    source.add_argument("--messages", help='JSON list, e.g. \'[{"role": "user", "content": "hi"}]\'')
    gen.add_argument("--max-new-tokens", type=int)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float)
    gen.add_argument("--repetition-penalty", type=float)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--gamma", type=int)
    gen.add_argument("--no-speculation", action="store_true", help="target-only decoding")
    gen.add_argument("--stream", action="store_true")
    gen.add_argument("--json", action="store_true", help="print the whole response, stats included")
    gen.add_argument("--timeout", type=float, default=600.0, help="deadline in seconds")
    gen.set_defaults(func=cmd_generate)
    return root


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    sys.exit(args.func(args))


if __name__ == "__main__":
    main()
