"""python -m coordinator --drafter HOST:PORT --verifier HOST:PORT --port P"""
from __future__ import annotations

import argparse
import logging
import sys

from specdec import telemetry
from specdec.cli_common import setup_logging
from specdec.errors import SpecdecError
from specdec.serving import run_until_signal

from coordinator.service import CoordinatorConfig, serve


def parse_gamma(value: str) -> int | None:
    if value == "auto":
        return None
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"--gamma takes auto or a positive integer, not {value!r}")
    return int(value)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m coordinator", description="specdec coordinator (public API)")
    parser.add_argument("--verifier", required=True, help="verifier address HOST:PORT")
    parser.add_argument("--drafter", help="drafter address HOST:PORT (omit for target-only or n-gram serving)")
    parser.add_argument("--proposer", default="drafter", choices=["drafter", "ngram"],
                        help="who drafts: the drafter service, or prompt lookup (no draft model)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=50051)
    parser.add_argument("--gamma", default="auto", type=parse_gamma,
                        help="draft tokens per round: auto (adapted per request from rolling acceptance) or N")
    parser.add_argument("--gamma-max", type=int, default=8, help="the most draft tokens auto picks per round")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="default when a request sets none")
    parser.add_argument("--trace-file", help="also write spans as OTLP-JSON lines to this file (tracing is off "
                        "unless this or OTEL_EXPORTER_OTLP_ENDPOINT is set)")
    parser.add_argument("--metrics-port", type=int, help="serve Prometheus metrics at http://HOST:PORT/metrics")
    parser.add_argument("--connect-timeout", type=float, default=300.0,
                        help="seconds to wait for the drafter and verifier to be SERVING")
    args = parser.parse_args(argv)
    setup_logging("coordinator")
    telemetry.configure("coordinator", args.trace_file)
    log = logging.getLogger("coordinator")
    config = CoordinatorConfig(drafter=args.drafter, verifier=args.verifier, proposer=args.proposer, gamma=args.gamma,
                               gamma_max=args.gamma_max, metrics_port=args.metrics_port, max_new_tokens=args.max_new_tokens, connect_timeout_s=args.connect_timeout)
    try:
        running, backends = serve(config, host=args.host, port=args.port)
    except (SpecdecError, TimeoutError) as exc:
        log.error("refusing to start: %s", exc)
        print(f"coordinator: refusing to start: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    print(f"coordinator SERVING on {args.host}:{running.port}", flush=True)
    run_until_signal(running, on_stop=backends.close)


if __name__ == "__main__":
    main()
