"""Flags and start-up pieces every service shares (logging, TLS, health port,
lifecycle): no torch, so the coordinator's process stays free of it."""
from __future__ import annotations

import argparse
import logging
import sys

from specdec.rpc.security import ServerTls
from specdec.rpc.serving import RunningServer, serve_health


def setup_logging(name: str) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s")


def add_tls_server_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("TLS")
    group.add_argument("--tls-cert", help="serve TLS with this certificate (PEM)")
    group.add_argument("--tls-key", help="... and this private key (PEM)")
    group.add_argument("--tls-client-ca", help="require client certificates signed by this CA (mutual TLS)")


def add_lifecycle_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--grace-period", type=float, default=25.0,
                        help="on SIGTERM, seconds in-flight calls get to finish before they are cancelled")
    parser.add_argument("--health-port", type=int,
                        help="also serve grpc.health.v1 alone, in plaintext, on this port (for kubelet probes)")
    parser.add_argument("--health-host",
                        help="bind address of --health-port (default: --host's, or loopback with --uds; a "
                             "kubelet probe needs 0.0.0.0)")


def start_health(running: RunningServer, args: argparse.Namespace) -> None:
    if args.health_port is not None:
        host = args.health_host or (None if getattr(args, "uds", None) else getattr(args, "host", None)) \
            or "127.0.0.1"
        serve_health(running, host, args.health_port)


def server_tls(args: argparse.Namespace) -> ServerTls | None:
    return ServerTls.from_args(args.tls_cert, args.tls_key, args.tls_client_ca)
