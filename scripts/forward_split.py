#!/usr/bin/env python
"""Where a forward's time goes: Linear layers, attention, and the rest (norms,
rotary, residuals, Python), for the forward the services run (`SequenceCache`),
one row and several, after a prefix. Measured with torch's profiler on the ops
each part calls; "rest" is the wall time the two others leave. Prints a table
and writes JSON.

  python scripts/forward_split.py --model qwen2.5-coder-1.5b-instruct --dtype bf16 --quantize int4
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

from torch.profiler import ProfilerActivity, profile

from specdec.runtime.kv_cache import SequenceCache
from specdec.runtime import torch_thread
from specdec.runtime.models import load_model

LINEAR_OPS = ("aten::_weight_int4pack_mm_for_cpu", "aten::_weight_int8pack_mm", "quantized::linear_dynamic",
              "aten::linear", "aten::mm", "aten::addmm")
ATTENTION_OPS = ("aten::scaled_dot_product_attention", "aten::bmm", "aten::softmax", "aten::masked_fill_")


def _counted_ancestor(event) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name in (*LINEAR_OPS, *ATTENTION_OPS):
            return True
        parent = parent.cpu_parent
    return False


def split(loaded, prefix: list[int], rows: int, repeats: int) -> dict[str, float]:
    """Median wall ms of a `rows`-row forward after `prefix`, and the profiled split."""
    def one(profiled: bool):
        seq = SequenceCache(loaded, prefix)
        seq.prefill()
        seq.forward([], keep_last=1)
        started = time.perf_counter()
        if profiled:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                seq.forward(prefix[1:rows + 1], keep_last=rows)
        else:
            seq.forward(prefix[1:rows + 1], keep_last=rows)
        return (time.perf_counter() - started) * 1e3, prof if profiled else None

    wall = statistics.median(one(False)[0] for _ in range(repeats))
    _, prof = one(True)
    totals = {"linear": 0.0, "attention": 0.0}
    for event in prof.events():
        part = "linear" if event.name in LINEAR_OPS else "attention" if event.name in ATTENTION_OPS else None
        if part is None or _counted_ancestor(event):
            continue  # e.g. aten::linear's own aten::mm
        totals[part] += event.cpu_time_total / 1e3
    # The profiler's overhead is per op, so it inflates the many small ops of "rest"
    # (taken as what the unprofiled wall time leaves), not the few large ones here.
    linear, attention = totals["linear"], totals["attention"]
    return {"wall_ms": wall, "linear_ms": linear, "attention_ms": attention,
            "rest_ms": max(wall - linear - attention, 0.0)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--quantize", default="int4")
    parser.add_argument("--forward", default="lean", choices=["lean", "hf"])
    parser.add_argument("--rows", default="1,4,5")
    parser.add_argument("--prefix", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="forward_split.json")
    args = parser.parse_args()
    torch_thread.set_threads(args.threads)
    loaded = load_model(args.model, dtype=args.dtype, quantize=args.quantize, forward=args.forward)
    ids = loaded.tokenizer.encode("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
                                  add_special_tokens=False)
    prefix = (ids * (args.prefix // len(ids) + 1))[:args.prefix]
    results = {f"{r}_rows": split(loaded, prefix, r, args.repeats) for r in map(int, args.rows.split(","))}
    print(f"{args.model} {loaded.dtype} forward={args.forward}, {args.threads} threads, {args.prefix}-token prefix")
    print(f"{'rows':>5s} {'wall':>9s} {'linear':>9s} {'attention':>10s} {'rest':>9s} {'non-linear':>11s}")
    for key, r in results.items():
        print(f"{key.split('_')[0]:>5s} {r['wall_ms']:6.1f} ms {r['linear_ms']:6.1f} ms {r['attention_ms']:7.1f} ms "
              f"{r['rest_ms']:6.1f} ms {1 - r['linear_ms'] / r['wall_ms']:10.0%}")
    pathlib.Path(args.out).write_text(json.dumps({"model": args.model, "dtype": loaded.dtype,
                                                  "forward": args.forward, **results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(torch_thread.run(main))  # all of it on the process's torch thread
