#!/usr/bin/env python
"""What a pair's forwards cost on llama.cpp itself, by rows: the bound a draft step
and a verification meet on this CPU with llama.cpp's own kernels and nothing of this
service around them. For each model (a registry name or a .gguf path), one forward
of k new tokens after a prefix, k = --rows, the median of 3 calls in each of --repeats
interleaved rounds, and the prefix's prefill per token, warm. Prints a Markdown table and writes JSON.

  python scripts/llama_rows.py [--models qwen2.5-coder-0.5b-instruct,qwen2.5-coder-1.5b-instruct]

Needs llama-cpp-python (`pip install ".[llama-cpp]"`).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

from specdec.runtime.models import gguf_source
from specdec.weights import registry

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from kernel_bench import cpu  # noqa: E402


def _gguf(name: str) -> str:
    if name in registry.MODELS:
        registry.pull(name)
    path = gguf_source(name)
    if path is None:
        sys.exit(f"{name!r} has no GGUF file: give a registry name or a .gguf path")
    return str(path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="qwen2.5-coder-0.5b-instruct,qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--rows", default="1,2,4,5,8,16")
    parser.add_argument("--prefix", type=int, default=120, help="tokens before the timed rows")
    parser.add_argument("--repeats", type=int, default=3, help="rounds over every row count")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="llama_rows.json")
    args = parser.parse_args()
    try:
        from llama_cpp import Llama
    except ImportError:
        sys.exit('llama-cpp-python is not installed: pip install ".[llama-cpp]"')
    rows = [int(r) for r in args.rows.split(",")]
    text = b"def quicksort(arr):\n    # sort a list of numbers in python, return a new list\n" * 40
    results = []
    for name in args.models.split(","):
        llm = Llama(model_path=_gguf(name), n_ctx=args.prefix + max(rows) + 64, n_threads=args.threads,
                    n_batch=512, logits_all=True, verbose=False)
        tokens = llm.tokenize(text)
        prefix, extra = tokens[:args.prefix], tokens[args.prefix:args.prefix + max(rows)]
        llm.eval(prefix)
        times: dict[int, list[float]] = {k: [] for k in rows}
        for _ in range(args.repeats):
            for k in rows:
                for _ in range(3):
                    llm.n_tokens = len(prefix)       # back to the prefix: its KV stays, the rows are new
                    started = time.perf_counter()
                    llm.eval(extra[:k])
                    times[k].append((time.perf_counter() - started) * 1e3)
        llm.n_tokens = 0                             # the prefix again, warm: its prefill per token
        started = time.perf_counter()
        llm.eval(prefix)
        prefill = (time.perf_counter() - started) * 1e3 / len(prefix)
        results.append({"model": name, "prefill_ms_per_token": prefill,
                        "ms_by_rows": {k: statistics.median(v) for k, v in times.items()}})
        del llm
    print(f"| llama.cpp, {args.threads} threads | " + " | ".join(f"{k} rows" for k in rows)
          + " | prefill ms/token |")
    print("|---" * (len(rows) + 2) + "|")
    for r in results:
        print(f"| {r['model']} | " + " | ".join(f"{r['ms_by_rows'][k]:.1f}" for k in rows)
              + f" | {r['prefill_ms_per_token']:.1f} |")
    if len(results) >= 2:
        print(f"\none-row step of {results[0]['model']} / {results[-1]['model']}: "
              f"{results[0]['ms_by_rows'][rows[0]] / results[-1]['ms_by_rows'][rows[0]]:.2f}")
    with open(args.out, "w") as f:
        json.dump({"machine": cpu(), "threads": args.threads,
                   "prefix": args.prefix, "results": results}, f, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
