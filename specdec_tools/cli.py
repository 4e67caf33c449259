"""The `specdec` command: `up` starts the three services, `generate` calls them.

The client side (`generate`, `traces`) starts without importing torch or
transformers: what the server side needs is imported inside its commands."""
from __future__ import annotations

import argparse
import json
import signal
import socket
import sys
import threading

import grpc
from google.protobuf import json_format

from coordinator.proposers import KINDS
from coordinator.settings import add_up_settings, up_passthrough as coordinator_passthrough
from specdec.runtime.options import FORWARDS
from specdec.runtime.quant import QUANTIZE
from specdec.service import settings as model_settings
from specdec.rpc.errors import SpecdecError
from specdec.weights.pairs import DEFAULT_PAIR, PAIRS
from specdec.rpc.security import ClientTls, load_token
from specdec.rpc.serving import channel
from specdec.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc


DEFAULT_HTTP_PORT = 8000


def port_free(host: str, port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind((host, port))
            return True
        except OSError:
            return False


def cmd_up(args: argparse.Namespace) -> int:
    from specdec_tools import launcher  # the server side: models, torch
    pair = PAIRS[args.pair]
    if args.http_port is None:   # the OpenAI-compatible API is on: at vLLM's 8000 where that is free
        args.http_port = DEFAULT_HTTP_PORT if port_free(args.host, DEFAULT_HTTP_PORT) else 0
    options = launcher.StackOptions.for_pair(
        pair, draft_model=args.draft_model, target_model=args.target_model, draft_quantize=args.draft_quantize,
        target_quantize=args.target_quantize, forward=args.forward,
        head_vocab=args.head_vocab, device=args.device, host=args.host, port=args.port, gamma=args.gamma,
        gamma_max=args.gamma_max, trace_file=args.trace_file, ready_timeout_s=args.ready_timeout,
        model_transport=args.model_transport, standby=args.standby, coordinator_args=coordinator_passthrough(args),
        drafter_args=model_settings.up_passthrough(args, "drafter"),
        verifier_args=model_settings.up_passthrough(args, "verifier"))

    def say(message: str, error: bool = False) -> None:
        print(f"specdec up: {message}", file=sys.stderr if error else sys.stdout, flush=True)
    if pair.target_from and options.target_model == pair.target:
        say(f"the {args.pair} pair's target is not in the model registry: download {pair.target_from} into a "
            f"directory (huggingface-cli download {pair.target_from} --local-dir DIR) and pass --target-model DIR"
            f"{'' if options.device != 'cpu' else '; it is a GPU pair (--device cuda)'}", error=True)
        return 2
    stack = launcher.Stack(options)
    stopping = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.set())
    try:
        launcher.pull_models([options.draft_model, options.target_model], say=say)
        coordinator = stack.launch()
        say(f"coordinator on {coordinator.address} (draft {options.draft_model}, target {options.target_model}); "
            "Ctrl-C stops all three")
        say(f"drafter on {stack.child('drafter').address}, verifier on {stack.child('verifier').address}")
        if coordinator.http_port:
            say(f"OpenAI-compatible API on http://{args.host}:{coordinator.http_port}/v1")
        # Like a process manager: a child that exits is restarted; only a signal stops the stack.
        supervisor = launcher.Supervisor(stack.children, lambda message: say(message, error=True))
        while not stopping.wait(0.1):   # a restart starts within 0.1 s of an exit
            supervisor.poll()
        return 0
    except (launcher.LaunchError, SpecdecError) as exc:
        say(str(exc), error=True)
        return 2
    finally:
        stack.stop()


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
    if args.proposer:
        request.speculation.proposer = coordinator_pb2.ProposerKind.Value(f"PROPOSER_KIND_{args.proposer.upper()}")
    return request


def cmd_generate(args: argparse.Namespace) -> int:
    request = build_request(args)
    try:
        tls = ClientTls.from_args(args.tls_ca, args.tls_cert, args.tls_key)
        token = load_token(args.auth_token_env, args.auth_token_file)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    with channel(args.addr, tls, token) as ch:
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
    if args.stats:
        s = response.stats
        print(f"[{len(response.token_ids)} tokens, {s.tokens_per_second:.2f} tok/s, "
              f"{coordinator_pb2.FinishReason.Name(response.finish_reason)}; {s.rounds} rounds, {s.draft_tokens} drafted (last gamma {s.gamma}), "
              f"acceptance {s.acceptance_rate:.2f}, mean accepted length {s.mean_accepted_length:.2f}; "
              f"prefill {s.prefill_ms:.0f} ms, draft {s.draft_ms:.0f} ms, verify {s.verify_ms:.0f} ms, "
              f"overhead {s.overhead_ms:.0f} ms; first token {s.first_token_ms:.0f} ms]", file=sys.stderr)
        if s.draft_sources:
            print("[" + "; ".join(f"{d.source}: {d.draft_tokens} drafted, {d.accepted_tokens} accepted"
                                  for d in s.draft_sources) + f"; {s.draft_bytes} bytes of drafts sent]",
                  file=sys.stderr)
        if s.fallback:
            print(f"[without the draft model: {s.fallback}]", file=sys.stderr)
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from specdec.weights import registry
    try:
        if args.action == "list":
            for entry in registry.MODELS.values():
                state = "pulled" if registry.is_pulled(entry) else "not pulled"
                print(f"{entry.name:30s} {entry.size / 1e6:8,.0f} MB  {state:10s}  {entry.description}")
            print(f"cache: {registry.home()} (set SPECDEC_HOME to move it)")
        elif args.action == "pull":
            default = PAIRS[DEFAULT_PAIR]
            for name in args.names or list(dict.fromkeys((default.draft, default.target))):
                print(registry.pull(name, on_step=lambda message: print(message, flush=True)))
        else:
            for name in args.names:
                print(registry.path(name))
    except SpecdecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="specdec", description="speculative decoding over gRPC")
    sub = root.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start drafter, verifier and coordinator on loopback")
    up.add_argument("--pair", default=DEFAULT_PAIR, choices=sorted(PAIRS))
    up.add_argument("--draft-model", help="overrides the pair's draft model")
    up.add_argument("--target-model", help="overrides the pair's target model")
    up.add_argument("--draft-quantize", choices=QUANTIZE, help="overrides the pair's setting")
    up.add_argument("--target-quantize", choices=QUANTIZE,
                    help="overrides the pair's setting (int4: the GGUF's own Q4_K blocks, CPU)")
    up.add_argument("--head-vocab", type=int, help="overrides the pair's INT8 draft head restriction")
    up.add_argument("--forward", choices=FORWARDS,
                    help="the model services' forward: lean (default; Llama/Qwen2 over a static KV cache), paged "
                         "(one KV arena and a static step, CUDA graphs on a GPU) or hf (transformers')")
    up.add_argument("--gamma", default="auto", help="auto (adapted per request) or a fixed N")
    up.add_argument("--gamma-max", type=int, default=0,
                    help="the most draft tokens auto picks per round (0: the verifier's measured cost curve decides, 8 without one)")
    up.add_argument("--trace-file", help="all three services append OTLP-JSON spans here (see specdec traces)")
    up.add_argument("--host", default="127.0.0.1", help="coordinator bind address")
    up.add_argument("--port", type=int, default=50051, help="coordinator port")
    up.add_argument("--device", default="cpu", help="cpu or cuda")
    up.add_argument("--ready-timeout", type=float, default=900.0, help="seconds to wait for each service")
    up.add_argument("--no-standby", dest="standby", action="store_false",
                    help="keep no spare process per service, its imports done, for restarts (each spare holds about "
                         "280 MB for a model service, 50 MB for the coordinator; a restart then re-imports torch, "
                         "some 3-5 s more)")
    add_up_settings(up)  # the coordinator's flags marked `up` in coordinator.settings, handed on as given
    model_settings.add_up_settings(up)  # --drafter-FLAG, --verifier-FLAG: specdec.service.settings
    up.add_argument("--model-transport", choices=["uds", "tcp"], default="uds",
                    help="how the coordinator reaches the drafter and verifier: Unix sockets in a private "
                         "directory (default: only this user can call them), or loopback TCP ports")
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
    gen.add_argument("--proposer", choices=tuple(KINDS),
                     help="who drafts for this request (default: the server's)")
    gen.add_argument("--stream", action="store_true")
    gen.add_argument("--json", action="store_true", help="print the whole response, stats included")
    gen.add_argument("--stats", action="store_true", help="then a one-line summary of the stats (stderr)")
    gen.add_argument("--timeout", type=float, default=600.0, help="deadline in seconds")
    gen.add_argument("--tls-ca", help="connect with TLS, trusting this CA")
    gen.add_argument("--tls-cert", help="client certificate, for mutual TLS")
    gen.add_argument("--tls-key", help="... and its key")
    gen.add_argument("--auth-token-env", metavar="VAR", help="send the bearer token in this environment variable")
    gen.add_argument("--auth-token-file", metavar="PATH", help="... or in this file")
    gen.set_defaults(func=cmd_generate)

    models = sub.add_parser("models", help="the model registry: list, pull NAME..., path NAME...")
    models.add_argument("action", choices=["list", "pull", "path"])
    models.add_argument("names", nargs="*", help="registry names (pull with none pulls the default pair)")
    models.set_defaults(func=cmd_models)

    bench = sub.add_parser("bench", help="Spec-Bench through the gRPC stack against the peers (see --help)",
                           add_help=False)
    bench.add_argument("bench_args", nargs=argparse.REMAINDER)
    load = sub.add_parser("load", help="N concurrent clients: latency p50/p99, errors, RSS (see --help)",
                          add_help=False)
    load.add_argument("load_args", nargs=argparse.REMAINDER)
    traces = sub.add_parser("traces", help="per-round table and summary from a --trace-file (see --help)",
                            add_help=False)
    traces.add_argument("traces_args", nargs=argparse.REMAINDER)
    return root


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # its options are its own (argparse.REMAINDER would not pass them on)
        from specdec_tools import bench
        sys.exit(bench.main(argv[1:]))
    if argv[:1] == ["load"]:
        from specdec_tools import load
        sys.exit(load.main(argv[1:]))
    if argv[:1] == ["traces"]:
        from specdec_tools import traces
        sys.exit(traces.main(argv[1:]))
    args = parser().parse_args(argv)
    sys.exit(args.func(args))


if __name__ == "__main__":
    main()
