"""python -m coordinator --drafter HOST:PORT --verifier HOST:PORT --port P"""
from __future__ import annotations

import argparse
import logging
import sys

from specdec.rpc import telemetry
from specdec.rpc.flags import config_from, server_tls, setup_logging, start_health
from specdec.rpc.errors import SpecdecError
from specdec.rpc.security import ClientTls, load_token
from specdec.rpc.serving import catch_stop_signals, run_until_signal

from specdec.spec.wire import Truncation

from coordinator.backends import watch_settings
from coordinator.service import CoordinatorConfig, serve
from coordinator.settings import HttpLimits, add_settings


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m coordinator", description="specdec coordinator (public API)")
    add_settings(parser)  # coordinator.settings: one declaration for this, `specdec up` and the chart's check
    return parser


def coordinator_config(args: argparse.Namespace) -> CoordinatorConfig:
    """The flags named as CoordinatorConfig's fields go over as they are; these are built."""
    return config_from(
        CoordinatorConfig, args, connect_timeout_s=args.connect_timeout, tls=server_tls(args),
        drafter_timeout_s=args.drafter_timeout, watch=watch_settings(args.session_lease),
        draft_truncation=Truncation(args.draft_top_k, args.draft_top_p),
        share_prefix_cache=args.share_prefix_cache == "on",
        http_limits=HttpLimits(args.http_max_body_bytes, args.http_header_timeout, args.http_body_timeout,
                               args.http_max_connections, args.http_keep_alive),
        auth_token=load_token(args.auth_token_env, args.auth_token_file),
        backend_tls=ClientTls.from_args(args.backend_tls_ca, args.backend_tls_cert, args.backend_tls_key),
        backend_auth_token=load_token(args.backend_auth_token_env, args.backend_auth_token_file))


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    setup_logging("coordinator")
    telemetry.configure("coordinator", args.trace_file)
    log = logging.getLogger("coordinator")
    try:
        config = coordinator_config(args)
        stopping = catch_stop_signals()
        running, backends = serve(config, host=args.host, port=args.port)
        start_health(running, args)
    except (SpecdecError, TimeoutError, ValueError, OSError) as exc:
        log.error("refusing to start: %s", exc)
        print(f"coordinator: refusing to start: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    print(f"coordinator SERVING on {running.address}" + (f" http={running.http_port}" if running.http_port else ""),
          flush=True)
    run_until_signal(running, grace_s=args.grace_period, on_stop=backends.close, stopping=stopping)


if __name__ == "__main__":
    main()
