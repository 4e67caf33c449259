"""python -m coordinator --drafter HOST:PORT --verifier HOST:PORT --port P"""
from __future__ import annotations

import argparse
import logging
import sys

from specdec.rpc import telemetry
from specdec.rpc.flags import add_lifecycle_args, add_tls_server_args, server_tls, setup_logging, start_health
from specdec.rpc.errors import SpecdecError
from specdec.rpc.security import ClientTls, load_token
from specdec.rpc.serving import MAX_PUBLIC_MESSAGE_BYTES
from specdec.rpc.serving import catch_stop_signals, run_until_signal

from specdec.spec.wire import Truncation

from coordinator.service import DEFAULT_DRAFT_TOP_K, DEFAULT_DRAFT_TOP_P, KIND_HYBRID, PROPOSERS, CoordinatorConfig, serve


def parse_gamma(value: str) -> int | None:
    if value == "auto":
        return None
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"--gamma takes auto or a positive integer, not {value!r}")
    return int(value)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m coordinator", description="specdec coordinator (public API)")
    parser.add_argument("--verifier", required=True, help="verifier address: HOST:PORT, or unix:PATH (sidecar mode)")
    parser.add_argument("--drafter", help="drafter address: HOST:PORT or unix:PATH (omit for target-only or n-gram "
                        "serving)")
    parser.add_argument("--proposer", default=KIND_HYBRID, choices=PROPOSERS,
                        help="who drafts unless a request says: hybrid (n-gram lookups in the prompt, the output and "
                        "recent outputs, free, then the drafter where they find nothing or beyond them), model (the "
                        "drafter alone) or ngram (the lookups alone, no drafter)")
    parser.add_argument("--draft-top-k", type=int, default=DEFAULT_DRAFT_TOP_K,
                        help="when sampling, the drafter samples from its top-k tokens, renormalized, and sends only "
                        "them (lossless: the verifier is told exactly that distribution); 0 with --draft-top-p 1 "
                        "sends the whole distribution (2 bytes per vocabulary entry per token)")
    parser.add_argument("--draft-top-p", type=float, default=DEFAULT_DRAFT_TOP_P,
                        help="... and from the fewest top tokens holding this much of its mass (1: off)")
    parser.add_argument("--lookup-history-tokens", type=int, default=0,
                        help="tokens of recent outputs that a caller's n-gram lookups search, kept per "
                        "authenticated caller (mTLS identity or bearer token; without auth, all callers are one): "
                        "what a lookup drafts shows in timing and stats (0, the default: none; each request "
                        "still searches its own prompt and output)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=50051)
    parser.add_argument("--gamma", default="auto", type=parse_gamma,
                        help="draft tokens per round: auto (adapted per request from rolling acceptance) or N")
    parser.add_argument("--gamma-max", type=int, default=0,
                        help="the most draft tokens auto picks per round (0: the verifier's measured cost curve decides, 8 without one)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="default when a request sets none")
    parser.add_argument("--trace-file", help="also write spans as OTLP-JSON lines to this file (tracing is off "
                        "unless this or OTEL_EXPORTER_OTLP_ENDPOINT is set)")
    parser.add_argument("--metrics-port", type=int, help="serve Prometheus metrics at http://HOST:PORT/metrics")
    parser.add_argument("--connect-timeout", type=float, default=300.0,
                        help="seconds to wait for the drafter and verifier to be SERVING")
    parser.add_argument("--max-sessions", type=int, default=64,
                        help="Generate calls served at once; beyond it, RESOURCE_EXHAUSTED")
    parser.add_argument("--max-message-bytes", type=int, default=MAX_PUBLIC_MESSAGE_BYTES,
                        help="largest request or response on the public port")
    parser.add_argument("--drafter-timeout", type=float, default=30.0,
                        help="seconds a drafter call may take before the request goes on without it")
    parser.add_argument("--log-prompts", action="store_true",
                        help="include prompt text in the request log (off by default: prompts are users' data)")
    add_tls_server_args(parser)
    auth = parser.add_argument_group("auth")
    auth.add_argument("--auth-token-env", metavar="VAR",
                      help="require 'authorization: Bearer <token>', the token read from this environment variable")
    auth.add_argument("--auth-token-file", metavar="PATH", help="... or from this file")
    backend = parser.add_argument_group("TLS to the drafter and verifier (when they serve TLS)")
    backend.add_argument("--backend-tls-ca", help="CA that signed their certificates")
    backend.add_argument("--backend-auth-token-env", metavar="VAR",
                         help="send this bearer token (from this environment variable) to the drafter and the "
                         "verifier, which require it over TCP unless they use mutual TLS")
    backend.add_argument("--backend-auth-token-file", metavar="PATH", help="... or the token in this file")
    backend.add_argument("--backend-tls-cert", help="this coordinator's client certificate (mutual TLS)")
    backend.add_argument("--backend-tls-key", help="... and its key")
    add_lifecycle_args(parser)
    args = parser.parse_args(argv)
    setup_logging("coordinator")
    telemetry.configure("coordinator", args.trace_file)
    log = logging.getLogger("coordinator")
    try:
        config = CoordinatorConfig(
            drafter=args.drafter, verifier=args.verifier, proposer=args.proposer, gamma=args.gamma,
            gamma_max=args.gamma_max, metrics_port=args.metrics_port, max_new_tokens=args.max_new_tokens,
            connect_timeout_s=args.connect_timeout, max_sessions=args.max_sessions,
            max_message_bytes=args.max_message_bytes, log_prompts=args.log_prompts, tls=server_tls(args),
            drafter_timeout_s=args.drafter_timeout,
            draft_truncation=Truncation(args.draft_top_k, args.draft_top_p),
            lookup_history_tokens=args.lookup_history_tokens,
            auth_token=load_token(args.auth_token_env, args.auth_token_file),
            backend_tls=ClientTls.from_args(args.backend_tls_ca, args.backend_tls_cert, args.backend_tls_key),
            backend_auth_token=load_token(args.backend_auth_token_env, args.backend_auth_token_file))
        stopping = catch_stop_signals()
        running, backends = serve(config, host=args.host, port=args.port)
        start_health(running, args)
    except (SpecdecError, TimeoutError, ValueError, OSError) as exc:
        log.error("refusing to start: %s", exc)
        print(f"coordinator: refusing to start: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    print(f"coordinator SERVING on {running.address}", flush=True)
    run_until_signal(running, grace_s=args.grace_period, on_stop=backends.close, stopping=stopping)


if __name__ == "__main__":
    main()
