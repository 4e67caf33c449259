#!/usr/bin/env python
"""A model's decode and verify calls through torch's ops against the same calls as
one ggml graph (specdec/runtime/ggml_forward.py), over the GGUF's blocks as they are and with
the Q4_K and Q4_0 weights repacked for ggml's GEMV, on one loaded model, side by side:
k new rows after a prefix, k = --rows, in --repeats interleaved rounds of three calls each
(with --gemm, also the repacked graph on ggml's GEMM, which serves no call).
Also whether a verification's rows come out as its decode steps, bit for bit, on a
real prompt through the graph. Prints a Markdown table and writes JSON.

  python scripts/graph_step.py [--model qwen2.5-coder-1.5b-instruct --dtype bf16 --quantize int4]
  python scripts/graph_step.py --model qwen2.5-coder-0.5b-instruct --dtype fp32 --quantize int4 --head-vocab 32768

Needs llama-cpp-python (`pip install ".[llama-cpp]"`).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import statistics
import sys
import time

# As the model services: OpenMP's idle workers sleep soon (specdec.runtime.torch_thread.SPIN_COUNT),
# before torch loads; else they spin some 15 ms after torch's ops, on the cores ggml's graph runs on.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

import torch  # noqa: E402

from specdec.runtime import ggml_forward, kernels, torch_thread  # noqa: E402
from specdec.runtime.models import load_model  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from kernel_bench import cpu  # noqa: E402

TEXT = "def quicksort(arr):\n    # sort a list of numbers in python, return a new list\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--quantize", default="int4")
    parser.add_argument("--head-vocab", type=int, default=0, help="the LM head cut to the N ids a target writes most")
    parser.add_argument("--rows", default="1,2,4,5,8")
    parser.add_argument("--prefix", type=int, default=200, help="tokens before the timed rows")
    parser.add_argument("--repeats", type=int, default=7, help="interleaved rounds of 3 calls of each path, by rows")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--torch-layers", choices=["chosen", "own"], default="chosen",
                        help="the torch forward's layers on the kernels they time fastest (ggml's among them), or on "
                             "torch's own only, as where llama-cpp-python does not install")
    parser.add_argument("--gemm", action="store_true",
                        help="also time the repacked graph taking up to 16 rows a graph, as ggml's GEMM does from 4 "
                             "rows (not served: its rows are not the one-row GEMV's bits)")
    parser.add_argument("--out", default="graph_step.json")
    args = parser.parse_args()
    if importlib.util.find_spec("llama_cpp") is None:
        sys.exit('llama-cpp-python is not installed: pip install ".[llama-cpp]"')
    torch_thread.set_threads(args.threads)
    if args.torch_layers == "own":
        kernels._usable["ggml"] = False   # the layers' per-row ggml kernel; the graph binds ggml itself
    loaded = load_model(args.model, dtype=args.dtype, quantize=args.quantize, head_vocab=args.head_vocab)
    lean = loaded.lean
    graphs = {}
    for name, repack in (("ggml-graph", False), ("ggml-graph-repacked", True)):
        try:
            graph = ggml_forward.GraphForward(lean)
        except ggml_forward.Unsupported as why:
            sys.exit(f"the ggml graph does not cover {args.model}: {why}")
        graph.place(repack=repack)
        if repack and not graph.repacked:
            print("ggml's repacked kernels do not run here for this model's types: the plain blocks only")
            continue
        if (reason := ggml_forward.check(lean, graph)) is not None:
            sys.exit(f"{name} failed its check: {reason}")
        graphs[name] = graph
    if args.gemm and "ggml-graph-repacked" in graphs:
        graph = ggml_forward.GraphForward(lean)
        graph.place(repack=True)
        graph.chunk_rows = 16
        graphs["ggml-graph-repacked-gemm"] = graph
    ids = loaded.tokenizer.encode(TEXT * (args.prefix // 10), add_special_tokens=False)
    prefix, extra = torch.tensor(ids[:args.prefix]), torch.tensor(ids[args.prefix:args.prefix + 16])
    rows = [int(r) for r in args.rows.split(",")]
    paths = {"torch": lambda items: lean._batch(items),
             **{name: (lambda items, graph=graph: ggml_forward.run_items(graph, items)) for name, graph in graphs.items()}}
    caches = {name: lean.new_cache() for name in paths}
    with torch.inference_mode():
        for cache in caches.values():
            lean._batch([(prefix, cache, 0)])
        times = {(name, k): [] for name in paths for k in rows}
        for _ in range(args.repeats):
            for k in rows:
                for name, run in paths.items():
                    # Three calls in a row, their median kept: the first after the other path
                    # can pay for the other's threads still spinning (OpenMP's, ggml's).
                    cache, calls = caches[name], []
                    for _ in range(3):
                        cache.length = len(prefix)
                        started = time.perf_counter()
                        run([(extra[:k], cache, k)])
                        calls.append((time.perf_counter() - started) * 1e3)
                    times[name, k].append(statistics.median(calls))
        # A verification of 8 rows against 8 decode steps, on each graph.
        same = {}
        for name, graph in graphs.items():
            steps, call = lean.new_cache(), lean.new_cache()
            for cache in (steps, call):
                lean._batch([(prefix, cache, 0)])
            one = torch.cat([ggml_forward.run_items(graph, [(extra[i:i + 1], steps, 1)])[0] for i in range(8)])
            eight = ggml_forward.run_items(graph, [(extra[:8], call, 8)])[0]
            same[name] = bool(torch.equal(one, eight))
    medians = {f"{name}/{k}": statistics.median(v) for (name, k), v in times.items()}
    print(f"{args.model} {loaded.dtype} {args.quantize}, {args.threads} threads, {args.prefix}-token prefix, "
          f"median ms over {args.repeats} interleaved rounds; torch's layers: {args.torch_layers}")
    print("| path | " + " | ".join(f"{k} rows" for k in rows) + " |")
    print("|---" * (len(rows) + 1) + "|")
    for name in paths:
        print(f"| {name} | " + " | ".join(f"{medians[f'{name}/{k}']:.1f}" for k in rows) + " |")
    for name in graphs:
        print(f"| {name} / torch | " + " | ".join(f"{medians[f'{name}/{k}'] / medians[f'torch/{k}']:.2f}"
                                                  for k in rows) + " |")
    print()
    for name, equal in same.items():
        print(f"8-row verification == 8 decode steps, bit for bit, on {name}: {equal}")
    pathlib.Path(args.out).write_text(json.dumps({
        "machine": cpu(), "model": args.model, "dtype": loaded.dtype, "quantize": args.quantize,
        "threads": args.threads, "torch_layers": args.torch_layers, "prefix": args.prefix, "ms": medians,
        "verify_equals_decode": same}, indent=2))
    print(f"wrote {args.out}")
    return 0 if all(equal for name, equal in same.items() if not name.endswith("-gemm")) else 1


if __name__ == "__main__":
    raise SystemExit(torch_thread.run(main))  # all of it on the process's torch thread
