#!/usr/bin/env python
"""A short prompt's prefill through the pair's served models, two ways in one
process, interleaved: every chunk on the quantized kernel (as a call that keeps
logits under dense_rows.MIN_ROWS rows takes), and as served, where a prefill
chunk takes whichever path its row bucket timed faster. Dense weights kept, as
`--prefill-weights dense` serves; the first round, which times the paths, is
not counted. Prints ms per prompt token and writes JSON.

  python benchmarks/prefill_time.py --tokens 8,16,32,48,63 --repeats 4
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

import torch

from specdec.runtime import dense_rows
from specdec.runtime.sequence import SequenceCache
from specdec.runtime.models import load_model
from specdec.weights.pairs import PAIRS


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default="qwen-coder", choices=sorted(PAIRS))
    parser.add_argument("--models", default="target,draft")
    parser.add_argument("--tokens", default="8,16,32,48,63", help="prompt lengths")
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="prefill_time.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    pair = PAIRS[args.pair]
    served = dense_rows.by_call

    def kernel_only(rows, prefill=None):  # every call as one that keeps logits
        return served(rows)

    sizes = [int(n) for n in args.tokens.split(",")]
    rows = []
    for which in args.models.split(","):
        loaded = (load_model(pair.target, dtype=pair.target_dtype, quantize=pair.target_quantize)
                  if which == "target" else
                  load_model(pair.draft, dtype=pair.draft_dtype, quantize=pair.draft_quantize,
                             head_vocab=pair.draft_head_vocab))
        dense_rows.keep(loaded.lean.linears() if loaded.lean else [loaded.model])
        times = {(path, n): [] for path in ("kernel", "served") for n in sizes}
        try:
            for repeat in range(args.repeats + 1):
                for n in sizes:
                    for path in ("kernel", "served"):
                        dense_rows.by_call = kernel_only if path == "kernel" else served
                        ids = [(7 * i + 3 + repeat) % 30000 for i in range(n + 1)]
                        seq = SequenceCache(loaded, ids)
                        started = time.perf_counter()
                        seq.prefill()  # all but the last token, as a session's start
                        if repeat:
                            times[(path, n)].append((time.perf_counter() - started) * 1e3 / n)
        finally:
            dense_rows.by_call = served
        for n in sizes:
            kernel, as_served = (statistics.median(times[(p, n)]) for p in ("kernel", "served"))
            rows.append({"model": which, "tokens": n, "kernel_ms_per_token": kernel, "served_ms_per_token": as_served})
    print("| model | prompt tokens | kernel only, ms a token | as served, ms a token | kernel / served |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['tokens']} | {r['kernel_ms_per_token']:.2f} | {r['served_ms_per_token']:.2f} | "
              f"{r['kernel_ms_per_token'] / r['served_ms_per_token']:.2f}× |")
    pathlib.Path(args.out).write_text(json.dumps({"pair": args.pair, "threads": args.threads, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
