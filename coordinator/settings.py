"""The coordinator's settings, declared once (specdec.rpc.flags.Setting): its
command line is built from this table, `specdec up` derives the flags it hands
the coordinator from it (`up`), and the chart's test checks that the chart sets
what it marks (`chart`) and nothing the command line does not know. No torch:
the CLI's client side reads it too."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from specdec.rpc import flags
from specdec.rpc.flags import Setting, shared
from specdec.rpc.serving import MAX_PUBLIC_MESSAGE_BYTES

from coordinator.proposers import KINDS
from specdec.spec.proposers import names as source_names

PROPOSER_CHOICES = tuple(KINDS)  # who drafts: coordinator.proposers
DEFAULT_DRAFT_TOP_K, DEFAULT_DRAFT_TOP_P = 256, 0.99  # the draft support sent when sampling


@dataclass(frozen=True)
class HttpLimits:
    """The HTTP front's limits (coordinator.http_limits); the flags below default to these."""
    max_body_bytes: int = MAX_PUBLIC_MESSAGE_BYTES   # as gRPC's largest message
    header_timeout_s: float = 10.0   # a request's headers, from the connection's start or its first byte
    body_timeout_s: float = 30.0     # a request's whole body, from the end of its headers
    max_connections: int = 1024      # open at once, kept-alive ones included
    keep_alive_s: float = 5.0        # an idle kept-alive connection is closed after this (uvicorn's default)


HTTP = HttpLimits()


def parse_gamma(value: str) -> int | None:
    if value == "auto":
        return None
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"--gamma takes auto or a positive integer, not {value!r}")
    return int(value)


S = Setting
SETTINGS: tuple[Setting, ...] = (
    S("--verifier", dict(required=True, help="verifier address: HOST:PORT, or unix:PATH (sidecar mode)"), chart=True),
    S("--drafter", dict(help="drafter address: HOST:PORT or unix:PATH (omit for target-only or n-gram serving)"),
      chart=True),
    S("--proposer", dict(default="hybrid", choices=PROPOSER_CHOICES,
                         help="who drafts unless a request says: " + "; ".join(f"{k.name} ({k.help})"
                                                                              for k in KINDS.values())
                              + ". A request may name its draft sources instead (speculation.sources): "
                              + ", ".join(source_names())),
      up=True, chart=True, values="proposer"),
    S("--draft-top-k", dict(type=int, default=DEFAULT_DRAFT_TOP_K,
                            help="when sampling, the drafter samples from its top-k tokens, renormalized, and sends "
                                 "only them (lossless: the verifier is told exactly that distribution); 0 with "
                                 "--draft-top-p 1 sends the whole distribution (2 bytes per vocabulary entry per "
                                 "token)"), up=True),
    S("--draft-top-p", dict(type=float, default=DEFAULT_DRAFT_TOP_P,
                            help="... and from the fewest top tokens holding this much of its mass (1: off)"), up=True),
    S("--lookup-history-tokens", dict(type=int, default=0,
                                      help="tokens of recent outputs that a caller's n-gram lookups search, kept per "
                                           "authenticated caller (mTLS identity or bearer token; without auth, all "
                                           "callers are one): what a lookup drafts shows in timing and stats (0, "
                                           "the default: none; each request still searches its own prompt and "
                                           "output)"), up=True, chart=True, values="lookupHistoryTokens"),
    S("--share-prefix-cache", dict(default="off", choices=("off", "on"),
                                   help="let authenticated callers reuse each other's cached prompt prefixes in the "
                                        "model services (a hit shows in timing, so by default each caller's blocks "
                                        "are keyed by its identity; requests still keep apart by cache_salt; "
                                        "without auth, all callers are one)"), up=True),
    S("--host", dict(default="127.0.0.1", help="bind address"), chart=True),
    S("--port", dict(type=int, default=50051), chart=True),
    S("--gamma", dict(default="auto", type=parse_gamma,
                      help="draft tokens per round: auto (adapted per request from rolling acceptance) or N"),
      chart=True, values="gamma"),
    S("--gamma-max", dict(type=int, default=0,
                          help="the most draft tokens auto picks per round (0: the verifier's measured cost curve "
                               "decides, 8 without one)"), chart=True, values="gammaMax"),
    S("--max-new-tokens", dict(type=int, default=128, help="default when a request sets none"), chart=True,
      values="maxNewTokens"),
    S("--trace-file", dict(help="also write spans as OTLP-JSON lines to this file (tracing is off unless this or "
                                "OTEL_EXPORTER_OTLP_ENDPOINT is set)")),
    S("--metrics-port", dict(type=int, help="serve Prometheus metrics at http://HOST:PORT/metrics"), up=True),
    S("--http-port", dict(type=int, help="serve the OpenAI-compatible HTTP API (/v1/chat/completions, "
                                         "/v1/completions, /v1/models, /health) on this port, beside gRPC (0 picks "
                                         "one; off unless set)"), up=True, chart=True),
    S("--http-max-body-bytes", dict(type=int, default=HTTP.max_body_bytes,
                                    help="largest HTTP request body; beyond, 413 (as gRPC's --max-message-bytes)"),
      up=True, chart=True, values="httpMaxBodyBytes"),
    S("--http-header-timeout", dict(type=float, default=HTTP.header_timeout_s,
                                    help="seconds an HTTP request's headers may take to arrive, from the "
                                         "connection's start or the request's first byte; beyond, 408 and closed"),
      up=True, chart=True, values="httpHeaderTimeoutSeconds"),
    S("--http-body-timeout", dict(type=float, default=HTTP.body_timeout_s,
                                  help="seconds an HTTP request's whole body may take to arrive; beyond, 408"),
      up=True, chart=True, values="httpBodyTimeoutSeconds"),
    S("--http-max-connections", dict(type=int, default=HTTP.max_connections,
                                     help="HTTP connections open at once; beyond, 503 and closed"),
      up=True, chart=True, values="httpMaxConnections"),
    S("--http-keep-alive", dict(type=float, default=HTTP.keep_alive_s,
                                help="seconds an idle kept-alive HTTP connection stays open"),
      up=True, chart=True, values="httpKeepAliveSeconds"),
    S("--connect-timeout", dict(type=float, default=300.0,
                                help="seconds to wait for the drafter and verifier to be SERVING"), chart=True,
      values="connectTimeoutSeconds"),
    S("--max-sessions", dict(type=int, default=64, help="Generate calls served at once; beyond it, RESOURCE_EXHAUSTED"),
      up=True, chart=True, values="maxSessions"),
    S("--max-message-bytes", dict(type=int, default=MAX_PUBLIC_MESSAGE_BYTES,
                                  help="largest request or response on the public port"), up=True),
    S("--drafter-timeout", dict(type=float, default=30.0,
                                help="seconds a drafter call may take before the request goes on without it"), up=True),
    S("--session-lease", dict(type=float, default=10.0,
                              help="seconds the drafter and verifier keep this coordinator's sessions after its "
                                   "last lease renewal (sent with every health check, each second): a coordinator "
                                   "that crashes or restarts has its sessions ended within this, not at their "
                                   "--session-ttl (0: no lease; at least 3 otherwise)"), up=True),
    S("--log-prompts", dict(action="store_true",
                            help="include prompt text in the request log (off by default: prompts are users' data)"),
      values="logPrompts"),   # a switch: the chart passes it where the value is true
    S("--auth-token-env", dict(metavar="VAR", help="require 'authorization: Bearer <token>', the token read from "
                                                   "this environment variable"), group="auth", up=True),
    S("--auth-token-file", dict(metavar="PATH", help="... or from this file"), group="auth", up=True),
    S("--backend-tls-ca", dict(help="CA that signed their certificates"), group="backends"),
    S("--backend-auth-token-env", dict(metavar="VAR", help="send this bearer token (from this environment variable) "
                                                           "to the drafter and the verifier, which require it over "
                                                           "TCP unless they use mutual TLS"), group="backends"),
    S("--backend-auth-token-file", dict(metavar="PATH", help="... or the token in this file"), group="backends"),
    S("--backend-tls-cert", dict(help="this coordinator's client certificate (mutual TLS)"), group="backends"),
    S("--backend-tls-key", dict(help="... and its key"), group="backends"),
    # Every service's TLS and lifecycle flags (specdec.rpc.flags.SHARED), marked for the coordinator.
    shared("--tls-cert", up=True), shared("--tls-key", up=True), shared("--tls-client-ca", up=True),
    shared("--health-port", up=True, chart=True, values="healthPort"), shared("--health-host", chart=True),
    shared("--grace-period", chart=True),
)
GROUPS = {"auth": "auth", "backends": "the drafter and verifier (TLS, token)"}


def add_settings(parser: argparse.ArgumentParser) -> None:
    flags.add_settings(parser, SETTINGS, GROUPS)


def add_up_settings(parser: argparse.ArgumentParser) -> None:
    """`specdec up`'s flags that go to the coordinator, under their own names."""
    flags.add_up_settings(parser, SETTINGS, "coordinator")


def up_passthrough(args: argparse.Namespace) -> tuple[str, ...]:
    return flags.up_passthrough(args, SETTINGS)
