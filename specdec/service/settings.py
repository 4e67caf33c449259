"""The model services' settings, declared once (specdec.rpc.flags.Setting):
`python -m drafter` and `python -m verifier` build their command lines from
this table, `specdec up` offers each setting marked `up` as --drafter-FLAG and
--verifier-FLAG and hands it to that service, and a setting with a `values` key
is the chart's container argument and schema entry (generated:
specdec_tools/chart_settings.py). No torch: `specdec up` reads it too."""
from __future__ import annotations

import argparse

from specdec.rpc import flags
from specdec.rpc.flags import Setting, shared
from specdec.runtime.cost_curve import CostCurve
from specdec.runtime.options import COMPILE, DTYPES, FORWARDS, PREFILL_WEIGHTS
from specdec.runtime.quant import QUANTIZE

SERVICES = ("drafter", "verifier")

S = Setting
MODEL_SETTINGS: tuple[Setting, ...] = (
    S("--model", dict(required=True, help="HF model directory, .gguf file, or registry name"), chart=True),
    S("--host", dict(default="127.0.0.1", help="bind address (default: loopback, sidecar mode)")),
    S("--port", dict(type=int, default=0, help="0 picks a free port")),
    S("--uds", dict(metavar="PATH", help="serve on this Unix domain socket instead of HOST:PORT (sidecar mode): only "
                                         "who can enter its directory (made 0700 if missing) can call the service")),
    S("--dtype", dict(default="fp32", choices=DTYPES), chart=True, values="dtype"),
    S("--device", dict(default="cpu", help="cpu or cuda"), chart=True, values="device"),
    S("--quantize", dict(default="none", choices=QUANTIZE,
                         help="int8: specdec's INT8 (the drafter's default in pairs); int4: the GGUF's own Q4_K "
                              "blocks on torch's int4 kernel (CPU), tensors stored at higher precision in int8; "
                              "q4_0: the weights rounded to Q4_0 for llama.cpp's kernels (a draft's, CPU). "
                              "Converted once and kept in the model cache"), chart=True, values="quantize"),
    S("--random-weights", dict(type=int, metavar="SEED",
                               help="BENCHMARK ONLY: build the model from --model's config.json with random weights "
                                    "drawn from this seed (in --dtype, on --device) instead of loading any; for timing "
                                    "real shapes where the weights cannot travel (step time does not depend on their "
                                    "values). --model is then a directory with config.json and the tokenizer's files"),
      up=True),
    S("--forward", dict(default="lean", choices=FORWARDS,
                        help="lean: specdec's forward for Llama/Qwen2 over a static KV cache per session (others "
                             "fall back to transformers'); paged: the same arithmetic as one static step over one KV "
                             "arena sized from the device's free memory, with a CUDA graph a row bucket on a GPU "
                             "(docs/gpu.md: not yet timed on one); hf: transformers' forward")),
    S("--compile", dict(default="off", choices=COMPILE,
                        help="with --forward paged: torch.compile each row bucket's static step with this backend "
                             "before its graph is captured (inductor on a GPU: the norms, rotary and activations "
                             "fuse, and an INT8 weight's cast folds into its 1-row matmuls; one compile a row "
                             "bucket, at warm-up on a GPU, at first use on a CPU; needs gcc and Python's headers "
                             "on a GPU (Triton's), a C++ compiler on a CPU; aot_eager: no fusion, only the "
                             "check that the step has no graph breaks, and slow: it writes the whole KV arena "
                             "every step)"), up=True),
    S("--head-vocab", dict(type=int, default=0,
                           help="with --quantize int8 or q4_0: cut the LM head to the N ids the target writes most (the "
                                "tokenizer's ranking in specdec/weights/vocab; the lowest ids without one) plus "
                                "special tokens (0 = whole vocabulary); lossless, it only changes what is proposed"),
      chart=True, values="headVocab"),
    S("--session-ttl", dict(type=float, default=600.0, help="seconds before an idle session is reaped"),
      up=True, chart=True, values="sessionTtlSeconds"),
    S("--max-sessions", dict(type=int, default=256, help="sessions held at once; beyond it, RESOURCE_EXHAUSTED"),
      up=True, chart=True, values="maxSessions"),
    S("--trace-file", dict(help="also write spans as OTLP-JSON lines to this file (tracing is off unless this or "
                                "OTEL_EXPORTER_OTLP_ENDPOINT is set)")),
    S("--threads", dict(type=int, default=0, help="torch CPU threads (0 = torch's default)"), up=True, chart=True,
      values="threads"),
    S("--cost-curve-rows", dict(type=int, default=17,
                                help="at warm-up, time one forward over 1..N new rows and publish the curve in Info, "
                                     "for the coordinator's choice of γ, and time the prefill paths of every chunk "
                                     "size (0 = do not measure; a chunk size is then timed at its first call)"), up=True),
    S("--cost-curve", dict(type=CostCurve.parse, metavar="MS,MS,...[:PREFILL_MS]",
                           help="publish this cost curve (ms of one forward over 1, 2, ... rows; the prefill's ms per "
                                "token) instead of timing one at warm-up; default: $SPECDEC_DRAFTER_COST_CURVE or "
                                "$SPECDEC_VERIFIER_COST_CURVE where set")),
    S("--kv-cache-mb", dict(type=float, default=0.0,
                            help="KV cache budget of all sessions together; growth past it is refused with "
                                 "RESOURCE_EXHAUSTED (0 = 40%% of the memory available at start; on a GPU, of its "
                                 "free memory)"), up=True, chart=True,
      values="kvCacheMb"),
    S("--prefill-chunk", dict(type=int, default=256,
                              help="prompt tokens per prefill forward: a long prompt holds up other sessions' rounds "
                                   "by one chunk at a time"), up=True),
    S("--prefill-weights", dict(default="dense", choices=PREFILL_WEIGHTS,
                                help="dense: keep a dense copy of the quantized layers' weights for calls of many rows "
                                     "(prefills), so they run as plain matmuls (2 bytes a weight more memory in bf16, "
                                     "4 where this CPU multiplies fp32 faster; logged at start); unpack: de-quantize "
                                     "each layer per call instead"), up=True),
    S("--prefix-cache", dict(default="on", choices=("on", "off"),
                             help="keep the KV of prompts' full 16-token blocks for later sessions with the same "
                                  "prefix and cache salt (a chat's next turn, a shared system prompt), within the KV "
                                  "pool: given back, least recently used first, when sessions need the room"),
      up=True),
    S("--kernel-rows", dict(type=int, default=1,
                            help="the rows a layer's one kernel for decode and verification calls is timed at, "
                                 "where it has several (llama.cpp's, fbgemm's, torch's): 1 favours one client's "
                                 "tokens per second; a service batching many sessions is served better by its "
                                 "usual rows a forward (8 clients: 8 or more)"), up=True),
    S("--start-profile", dict(default="on", choices=("on", "off"),
                              help="keep what this service times at start (kernel choices, cost curves) in "
                                   "$SPECDEC_HOME/starts/, per machine, libraries, model and settings, and reuse it at "
                                   "the next start once a decode step timed then agrees (docs/reliability-and-"
                                   "security.md); off: time everything at every start"), up=True),
    S("--batch-invariant", dict(action="store_true",
                                help="rows of several sessions in one forward get the bits each session alone would "
                                     "(the kernels a decode step needs, row by row): a session's output never depends "
                                     "on who else is served, at the cost of batching (8 clients' rows cost about 5x "
                                     "one's on a 2-core CPU, docs/batching.md); default: the kernels timed fastest for "
                                     "the batch's rows, as vLLM and SGLang do, where other rows may move a session's "
                                     "rounding at near-ties"), up=True),
    S("--max-batch-rows", dict(type=int, default=512,
                               help="most rows in one batched forward (within it, the cost curve sizes each batch)"),
      up=True),
    S("--auth-token-env", dict(metavar="VAR",
                               help="require 'authorization: Bearer <token>' (the coordinator's "
                                    "--backend-auth-token-*) on every call but health checks, the token read from "
                                    "this environment variable; off loopback the service refuses to start without "
                                    "this or mutual TLS"), group="auth"),
    S("--auth-token-file", dict(metavar="PATH", help="... or from this file"), group="auth"),
    shared("--tls-cert"), shared("--tls-key"), shared("--tls-client-ca"),
    shared("--health-port", chart=True, values="healthPort"), shared("--health-host", chart=True),
    shared("--grace-period", chart=True),
)


# One service's own settings, beside MODEL_SETTINGS; handed to its serve() by name.
OWN_SETTINGS: dict[str, tuple[Setting, ...]] = {
    "drafter": (),
    "verifier": (
        S("--synthetic-acceptance", dict(type=float, default=0.0, metavar="RATE",
                                         help="BENCHMARK ONLY, not lossless: accept each draft token with this "
                                              "probability whatever the models say (vLLM's synthetic rejection), to "
                                              "time random-weight pairs at a real pair's acceptance; logged at start "
                                              "and marked in every response's stats (0 = off)"), up=True),
    ),
}


def service_settings(name: str) -> tuple[Setting, ...]:
    return MODEL_SETTINGS + OWN_SETTINGS[name]


def own_options(args: argparse.Namespace, name: str) -> dict:
    """The service's own settings as its serve() takes them."""
    return {s.dest: getattr(args, s.dest) for s in OWN_SETTINGS[name]}


def model_service_parser(name: str) -> argparse.ArgumentParser:
    """`python -m drafter` or `python -m verifier`'s command line."""
    parser = argparse.ArgumentParser(prog=f"python -m {name}", description=f"specdec {name} service",
                                     allow_abbrev=False)  # a flag is named whole (the chart refuses some by name)
    flags.add_settings(parser, service_settings(name))
    return parser


def add_up_settings(parser: argparse.ArgumentParser) -> None:
    """`specdec up`'s --drafter-FLAG and --verifier-FLAG, each unset unless given."""
    for service in SERVICES:
        flags.add_up_settings(parser, service_settings(service), service, prefix=f"{service}-")


def up_passthrough(args: argparse.Namespace, service: str) -> tuple[str, ...]:
    """The flags `specdec up` was given for `service`, as they go on its command line."""
    return flags.up_passthrough(args, service_settings(service), prefix=f"{service}-")
