"""Running `python -m drafter` and `python -m verifier` (their flags: specdec.service.settings)."""
from __future__ import annotations

import argparse
import logging
import sys
from typing import Callable

from specdec.rpc import telemetry
from specdec.rpc.errors import SpecdecError
from specdec.rpc.flags import config_from, server_tls, setup_logging, start_health
from specdec.rpc.security import load_token
from specdec.rpc.serving import RunningServer, catch_stop_signals, run_until_signal
from specdec.runtime import torch_thread
from specdec.runtime.models import LoadedModel, load_model
from specdec.service.model_service import ServeConfig
from specdec.service.settings import own_options


def serve_config(args: argparse.Namespace) -> ServeConfig:
    """The flags named as ServeConfig's fields go over as they are; these are built."""
    return config_from(ServeConfig, args, tls=server_tls(args), auth_token=load_token(args.auth_token_env,
                       args.auth_token_file), session_ttl_s=args.session_ttl, start_profile_setting=args.start_profile)


def run_model_service(name: str, args: argparse.Namespace,
                      serve: Callable[..., RunningServer]) -> None:
    setup_logging(name)
    log = logging.getLogger(name)
    if args.threads:
        torch_thread.set_threads(args.threads)
    telemetry.configure(name, args.trace_file)
    try:
        config = serve_config(args)   # a bad TLS file or token fails before the model loads
        loaded: LoadedModel = load_model(args.model, dtype=args.dtype, device=args.device, quantize=args.quantize,
                                        head_vocab=args.head_vocab, forward=args.forward, compile=args.compile,
                                        random_weights=args.random_weights)
        stopping = catch_stop_signals()
        running = serve(loaded, config=config, **own_options(args, name))
        start_health(running, args)
    except (SpecdecError, ValueError, OSError) as exc:
        log.error("%s", exc)
        sys.exit(2)
    # One parseable line, for `specdec up` and for people.
    print(f"{name} SERVING on {running.address} model={loaded.name}", flush=True)
    run_until_signal(running, grace_s=args.grace_period, stopping=stopping)
