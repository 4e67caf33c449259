"""Settings and start-up pieces every service shares: a `Setting` declares one
flag once, for the service's command line, `specdec up`'s pass-through and the
chart's check; the TLS and lifecycle flags every service takes (SHARED); logging
and the health port. No torch, so the coordinator's process stays free of it."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from dataclasses import dataclass, field
from typing import Sequence

from specdec.rpc.security import ServerTls
from specdec.rpc.serving import RunningServer, serve_health


def setup_logging(name: str) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s")


@dataclass(frozen=True)
class Setting:
    flag: str
    options: dict = field(default_factory=dict)  # argparse's: type, default, choices, action, metavar, help
    group: str = ""          # the help section it is listed in
    up: bool = False         # `specdec up` takes it and hands it to the service as it is
    chart: bool = False      # the Helm chart sets it on every such container it renders
    # The chart's values key it is derived from (templates/_settings.tpl and the values
    # schema are generated from it: specdec_tools/chart_settings.py); "": set by hand, if at all
    values: str = ""
    shared: bool = False     # one of SHARED, which every service takes

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")


SHARED: dict[str, Setting] = {s.flag: s for s in (
    Setting("--tls-cert", dict(help="serve TLS with this certificate (PEM)"), group="TLS"),
    Setting("--tls-key", dict(help="... and this private key (PEM)"), group="TLS"),
    Setting("--tls-client-ca", dict(help="require client certificates signed by this CA (mutual TLS)"), group="TLS"),
    Setting("--grace-period", dict(type=float, default=25.0,
                                   help="on SIGTERM, seconds in-flight calls get to finish before they are cancelled")),
    Setting("--health-port", dict(type=int, help="also serve grpc.health.v1 alone, in plaintext, on this port (for "
                                                 "kubelet probes)")),
    Setting("--health-host", dict(help="bind address of --health-port (default: --host's, or loopback with --uds; a "
                                       "kubelet probe needs 0.0.0.0)")),
)}


def shared(flag: str, **marks) -> Setting:
    """One of SHARED in a service's table, with that service's marks (up, chart)."""
    return dataclasses.replace(SHARED[flag], shared=True, **marks)


def config_from(config_class: type, args: argparse.Namespace, **built):
    """A service's config dataclass from its parsed command line: each field named
    as a flag's dest takes that flag's value, so a new setting is its `Setting`
    and its field (and, for the chart, its default in values.yaml), with no line
    here to hand it over. `built`: the fields made from several flags, or
    converted on the way (TLS, tokens, "on"/"off" switches)."""
    fields = {f.name for f in dataclasses.fields(config_class)}
    return config_class(**{**{k: v for k, v in vars(args).items() if k in fields}, **built})


def add_settings(parser: argparse.ArgumentParser, settings: Sequence[Setting],
                 groups: dict[str, str] | None = None) -> None:
    """A service's command line from its table, SHARED's flags included once."""
    titles = {**(groups or {}), "TLS": "TLS"}
    sections: dict[str, argparse._ArgumentGroup] = {}
    listed = {s.flag for s in settings}
    for s in [*settings, *(s for flag, s in SHARED.items() if flag not in listed)]:
        if s.group:
            section = sections.setdefault(s.group, parser.add_argument_group(titles.get(s.group, s.group)))
            section.add_argument(s.flag, **s.options)
        else:
            parser.add_argument(s.flag, **s.options)


def add_up_settings(parser: argparse.ArgumentParser, settings: Sequence[Setting], service: str,
                    prefix: str = "") -> None:
    """`specdec up`'s flags for a service's settings marked `up`, as `--PREFIXflag`:
    each unset unless given."""
    for s in settings:
        if s.up:
            options = {k: v for k, v in s.options.items() if k in ("type", "choices", "metavar")}
            if s.options.get("action") == "store_true":  # a switch stays a switch; unset: None, the service's default
                options = {"action": "store_const", "const": True}
            parser.add_argument("--" + prefix + s.flag.removeprefix("--"), dest=prefix.replace("-", "_") + s.dest,
                                help=f"{service}: {s.options.get('help', '')}", **options)


def up_passthrough(args: argparse.Namespace, settings: Sequence[Setting], prefix: str = "") -> tuple[str, ...]:
    """The service's flags `specdec up` was given, as they go on its command line."""
    out: list[str] = []
    for s in settings:
        value = getattr(args, prefix.replace("-", "_") + s.dest, None) if s.up else None
        if value is True and s.options.get("action") == "store_true":
            out.append(s.flag)
        elif value is not None:
            out += [s.flag, str(value)]
    return tuple(out)


def start_health(running: RunningServer, args: argparse.Namespace) -> None:
    if args.health_port is not None:
        host = args.health_host or (None if getattr(args, "uds", None) else getattr(args, "host", None)) \
            or "127.0.0.1"
        serve_health(running, host, args.health_port)


def server_tls(args: argparse.Namespace) -> ServerTls | None:
    return ServerTls.from_args(args.tls_cert, args.tls_key, args.tls_client_ca)
