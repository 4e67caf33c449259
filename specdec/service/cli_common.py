"""Command-line plumbing shared by `python -m drafter` and `python -m verifier`."""
from __future__ import annotations

import argparse
import logging
import sys
from typing import Callable

from specdec.rpc import telemetry
from specdec.rpc.errors import SpecdecError
from specdec.rpc.flags import add_lifecycle_args, add_tls_server_args, server_tls, setup_logging, start_health
from specdec.rpc.security import load_token
from specdec.rpc.serving import RunningServer, catch_stop_signals, run_until_signal
from specdec.runtime import torch_thread
from specdec.runtime.cost_curve import CostCurve
from specdec.runtime.models import QUANTIZE, LoadedModel, load_model


def model_service_parser(name: str) -> argparse.ArgumentParser:
    """`python -m drafter` or `python -m verifier`'s command line."""
    parser = argparse.ArgumentParser(prog=f"python -m {name}", description=f"specdec {name} service")
    add_model_args(parser, default_quantize="none")
    return parser


def add_model_args(parser: argparse.ArgumentParser, default_quantize: str) -> None:
    parser.add_argument("--model", required=True, help="HF model directory, .gguf file, or registry name")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback, sidecar mode)")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--uds", metavar="PATH",
                        help="serve on this Unix domain socket instead of HOST:PORT (sidecar mode): only who can "
                             "enter its directory (made 0700 if missing) can call the service")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--quantize", default=default_quantize, choices=QUANTIZE,
                        help="int8: specdec's INT8 (the drafter's default in pairs); int4: the GGUF's own Q4_K "
                             "blocks on torch's int4 kernel (CPU), tensors stored at higher precision in int8. "
                             "Converted once and kept in the model cache")
    parser.add_argument("--forward", default="lean", choices=["lean", "hf"],
                        help="lean: specdec's forward for Llama/Qwen2 over a static KV cache (others fall back "
                             "to transformers'); hf: transformers' forward")
    parser.add_argument("--head-vocab", type=int, default=0,
                        help="with --quantize int8: restrict the LM head to the N lowest (most frequent) ids "
                             "plus special tokens (0 = whole vocabulary); lossless, it only changes what is proposed")
    parser.add_argument("--session-ttl", type=float, default=600.0, help="seconds before an idle session is reaped")
    parser.add_argument("--max-sessions", type=int, default=256)
    parser.add_argument("--trace-file", help="also write spans as OTLP-JSON lines to this file (tracing is off "
                        "unless this or OTEL_EXPORTER_OTLP_ENDPOINT is set)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    parser.add_argument("--cost-curve-rows", type=int, default=17,
                        help="at warm-up, time one forward over 1..N new rows and publish the curve in Info, "
                             "for the coordinator's choice of γ (0 = do not measure)")
    parser.add_argument("--cost-curve", type=CostCurve.parse, metavar="MS,MS,...[:PREFILL_MS]",
                        help="publish this cost curve (ms of one forward over 1, 2, ... rows; the prefill's ms "
                             "per token) instead of timing one at warm-up; default: $SPECDEC_DRAFTER_COST_CURVE "
                             "or $SPECDEC_VERIFIER_COST_CURVE where set")
    parser.add_argument("--kv-cache-mb", type=float, default=0.0,
                        help="KV cache budget of all sessions together; growth past it is refused with "
                             "RESOURCE_EXHAUSTED (0 = 40%% of the memory available at start)")
    parser.add_argument("--prefill-chunk", type=int, default=256,
                        help="prompt tokens per prefill forward: a long prompt holds up other sessions' rounds "
                             "by one chunk at a time")
    parser.add_argument("--max-batch-rows", type=int, default=512,
                        help="most rows in one batched forward (within it, the cost curve sizes each batch)")
    add_tls_server_args(parser)
    auth = parser.add_argument_group("auth")
    auth.add_argument("--auth-token-env", metavar="VAR",
                      help="require 'authorization: Bearer <token>' (the coordinator's --backend-auth-token-*) on "
                           "every call but health checks, the token read from this environment variable; off "
                           "loopback the service refuses to start without this or mutual TLS")
    auth.add_argument("--auth-token-file", metavar="PATH", help="... or from this file")
    add_lifecycle_args(parser)


def run_model_service(name: str, args: argparse.Namespace,
                      serve: Callable[..., RunningServer]) -> None:
    setup_logging(name)
    log = logging.getLogger(name)
    if args.threads:
        torch_thread.set_threads(args.threads)
    telemetry.configure(name, args.trace_file)
    try:
        tls = server_tls(args)
        token = load_token(args.auth_token_env, args.auth_token_file)
        loaded: LoadedModel = load_model(args.model, dtype=args.dtype, device=args.device, quantize=args.quantize,
                                        head_vocab=args.head_vocab, forward=args.forward)
        stopping = catch_stop_signals()
        running = serve(loaded, host=args.host, port=args.port, session_ttl_s=args.session_ttl,
                        max_sessions=args.max_sessions, tls=tls, uds=args.uds,
                        cost_curve_rows=args.cost_curve_rows, cost_curve=args.cost_curve,
                        kv_cache_mb=args.kv_cache_mb,
                        prefill_chunk=args.prefill_chunk, max_batch_rows=args.max_batch_rows, auth_token=token)
        start_health(running, args)
    except (SpecdecError, ValueError, OSError) as exc:
        log.error("%s", exc)
        sys.exit(2)
    # One parseable line, for `specdec up` and for people.
    print(f"{name} SERVING on {running.address} model={loaded.name}", flush=True)
    run_until_signal(running, grace_s=args.grace_period, stopping=stopping)
