#!/usr/bin/env python
"""What each row of a call costs on llama.cpp's kernels, by block type: one Linear
(`specdec.runtime.ggml.GgmlLinear`, up to 16 rows a graph) over a random weight
in Q4_K, Q8_0 and Q4_0, as ggml holds them and, where ggml lays the type out for
its repacked GEMV and GEMM, repacked. Each cell is the median ms of its calls over
copies of the weight (rotated past the last-level cache, as a decode step reads
its weights); `*` marks a row count whose rows are not bit for bit their one-row
calls (a verification there would not be its decode steps). Needs llama-cpp-python
(`pip install ".[llama-cpp]"`). Prints a table and writes JSON.

    python scripts/ggml_rows.py [--shape 8960x1536] [--rows 1,2,3,4,5,8,12,16] [--copies 10] [--rounds 5]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from specdec.runtime import ggml  # noqa: E402

TYPES = {"Q4_K": ggml.Q4_K, "Q8_0": 8, "Q4_0": ggml.Q4_0}


def blocks_of(kind: int, out_features: int, in_features: int) -> torch.Tensor:
    if kind == ggml.Q4_K:   # gguf's own quantizer has no Q4_K: valid random blocks
        return ggml.probe_blocks(kind, out_features, in_features)
    from gguf.quants import quantize
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(0)).numpy()
    return torch.from_numpy(quantize(weight, kind)).reshape(out_features, -1)


def measure(name: str, kind: int, repack: bool, shape: tuple[int, int], rows: list[int], copies: int,
            rounds: int) -> dict:
    out_features, in_features = shape
    blocks = blocks_of(kind, out_features, in_features)
    layers = []
    for _ in range(copies):
        layer = ggml.GgmlLinear(blocks.clone(), kind, in_features, repack=repack)
        layer.chunk_rows = max(rows)   # every call one graph, whatever ggml then does with its rows
        layers.append(layer)
    x = torch.randn(max(rows), in_features, generator=torch.Generator().manual_seed(1))
    alone = torch.cat([layers[0](x[i:i + 1]) for i in range(max(rows))])
    cells = {}
    for n in rows:
        exact = torch.equal(layers[0](x[:n]), alone[:n])
        for layer in layers:   # warm-up: each copy's graph for n rows built
            layer(x[:n])
        times = []
        for _ in range(rounds):
            for layer in layers:
                started = time.perf_counter()
                layer(x[:n])
                times.append((time.perf_counter() - started) * 1e3)
        cells[n] = {"ms": statistics.median(times), "rows_alone": exact}
    return {"type": name + (" repacked" if repack else ""), "mb": blocks.numel() / 1e6, "rows": cells}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="8960x1536", help="out x in")
    parser.add_argument("--rows", default="1,2,3,4,5,8,12,16")
    parser.add_argument("--copies", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="ggml_rows.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ggml.selftest()
    shape = tuple(int(v) for v in args.shape.split("x"))
    rows = [int(v) for v in args.rows.split(",")]
    results = []
    for name, kind in TYPES.items():
        for repack in (False, True):
            if repack and not ggml.repackable(kind, shape[0]):
                print(f"{name}: not repacked here", file=sys.stderr)
                continue
            results.append(measure(name, kind, repack, shape, rows, args.copies, args.rounds))
            print(f"{results[-1]['type']}: done", file=sys.stderr, flush=True)
    print(f"\n{args.shape}, {args.threads} threads, ms a call (* rows not their one-row calls' bits)")
    print("| type | " + " | ".join(f"{n} rows" for n in rows) + " |\n|---|" + "---|" * len(rows))
    for r in results:
        print(f"| {r['type']} | " + " | ".join(
            f"{r['rows'][n]['ms']:.3f}{'' if r['rows'][n]['rows_alone'] else '*'}" for n in rows) + " |")
    pathlib.Path(args.out).write_text(json.dumps({"shape": args.shape, "threads": args.threads, "results": results},
                                                 indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
