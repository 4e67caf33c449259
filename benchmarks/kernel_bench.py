"""Linear-layer kernels side by side: ms of y = x W^T by weight shape and rows,
for every backend that installs here (a missing one is skipped with a line).

    python benchmarks/kernel_bench.py [--shapes 1536x8960,...] [--rows 1,2,4,...] [--threads N] [--out FILE.json]

Weights are rotated past the last-level cache (as many copies as it takes to
fill four times it), so each call reads its weight from memory as a decode step
does (up to 2 GiB of copies: a virtual machine may report a whole socket's
cache). Each cell is the median of timed calls after warm-up calls. The table
prints as Markdown; --out writes it as JSON with the machine (CPU model and
flags, threads, torch version).

Backends:
  torch-int4       torch's int4 weight-only CPU kernel (`_weight_int4pack_mm_for_cpu`), bf16 activations (the int4 target's)
  fbgemm-int8      fbgemm's dynamic int8 GEMM, int8 activations per call (the INT8 drafter's)
  torch-int8-wo    torch's int8 weight-only kernel (`_weight_int8pack_mm`), bf16 activations
  bf16             a dense bf16 matmul (oneDNN)
  fp32             a dense fp32 matmul (the prefill path's where bf16 multiplies slower: dense_rows.matmul_dtype)
  fbgemm-int8-row  fbgemm's dynamic int8 GEMM made per row (specdec.runtime.kernels: each row mapped onto [-1, 1],
                   the call's range pinned), int8 activations per row (what the int4 target's gate/up and head may run)
  zentorch-int8    zentorch's dynamic int8 x int8 linear (optional: `pip install zentorch`)
  zentorch-w4a8    zentorch's dynamic int8 x int4 linear over the same Q4_K codes: signed codes (q - 8) with
                   the group scales, int8 activations per row, and the zeros added back as the group sums of
                   x times them (optional: `pip install zentorch`)
  ggml             llama.cpp's kernels (ggml) over the weight as a GGUF Q4_K tensor (Q8_0 where K is not a
                   multiple of 256), activations rounded to
                   8 bits per block of 256 of a row (specdec.runtime.ggml; optional: `pip install ".[llama-cpp]"`)
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import warnings

import torch
import torch.nn.functional as F

from specdec.runtime import kernels, native_backends

SHAPES = ["1536x8960", "8960x1536", "151936x896", "151936x1536"]   # out x in
ROWS = [1, 2, 4, 5, 8, 16, 64, 256]
GROUP = 32
ROTATE_MAX = 2 * 2 ** 30   # bytes of weight copies at most, whatever the cache reports


def l3_bytes() -> int:
    try:
        for index in sorted(os.listdir("/sys/devices/system/cpu/cpu0/cache")):
            path = f"/sys/devices/system/cpu/cpu0/cache/{index}"
            if open(f"{path}/level").read().strip() == "3":
                size = open(f"{path}/size").read().strip()
                return int(size[:-1]) * (1024 if size.endswith("K") else 1024 ** 2)
    except OSError:
        pass
    return 32 * 2 ** 20


def cpu() -> dict:
    info = {"machine": platform.machine(), "model": "", "flags": []}
    try:
        text = open("/proc/cpuinfo").read()
        for line in text.splitlines():
            if line.startswith("model name") and not info["model"]:
                info["model"] = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = line.split(":", 1)[1].split()
                info["flags"] = sorted(f for f in flags if f.startswith(("avx", "amx")) or f in ("fma", "f16c"))
                break
    except OSError:
        pass
    return info


# Each backend: build(weight fp32 [N, K]) -> state; call(state, x fp32 [M, K]) -> y.

def q4(w):
    """w [N, K] -> Q4_K's form, per group of 32: codes q in 0..15, scale, minimum with w ~ scale * q - minimum."""
    n, k = w.shape
    g = w.view(n, k // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    codes = ((g - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32).view(n, k)
    return codes, scale, -lo


def build_int4(w):
    codes, scale, minimum = q4(w)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 2)
    sz = torch.stack([scale.t(), (8 * scale - minimum).t()], -1).bfloat16().contiguous()
    return packed, sz


def call_int4(state, x):
    packed, sz = state
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x.bfloat16(), packed, GROUP, sz)


def build_fbgemm(w):
    scales = w.abs().amax(1).clamp(min=1e-8) / 127
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = torch.quantize_per_channel(w, scales.double(), torch.zeros(w.shape[0], dtype=torch.long), 0, torch.qint8)
    return torch.ops.quantized.linear_prepack(q, None)


def call_fbgemm(state, x):
    return torch.ops.quantized.linear_dynamic(x, state, False)


def build_int8_wo(w):
    scales = w.abs().amax(1).clamp(min=1e-8) / 127
    return torch.round(w / scales[:, None]).to(torch.int8), scales.bfloat16()


def call_int8_wo(state, x):
    return torch._weight_int8pack_mm(x.bfloat16(), *state)


def build_bf16(w):
    return w.bfloat16()


def call_bf16(state, x):
    return F.linear(x.bfloat16(), state)


def build_fp32(w):
    return w.float().contiguous()


def call_fp32(state, x):
    return F.linear(x.float(), state)


def build_zentorch(w):
    import zentorch  # noqa: F401 - registers torch.ops.zentorch
    scales = (w.abs().amax(1).clamp(min=1e-8) / 127).float()
    codes = torch.round(w / scales[:, None]).to(torch.int8)
    packed = torch.ops.zentorch.zentorch_weight_prepack_for_dynamic_qlinear(codes.contiguous())
    return packed, scales


def call_zentorch(state, x):
    packed, scales = state
    return torch.ops.zentorch.zentorch_dynamic_qlinear(x.bfloat16(), packed, scales, None, is_weight_prepacked=True)


def w4a8_state(codes, scale, minimum):
    """Q4_K's w = s q - m per group as s (q - 8) + z, z = 8 s - m: zentorch's int4 x int8 op takes the
    symmetric part (its codes two to a byte, low nibble first; scales [K/32, N]); the zeros come back
    as a small [M, K/32] x [K/32, N] product of the group sums of x. codes [N, K] in 0..15, scale and
    minimum [N, K/32]."""
    import zentorch  # noqa: F401 - registers torch.ops.zentorch
    signed = ((codes.to(torch.int32) - 8) & 15).to(torch.uint8)
    packed = (signed[:, 0::2] | (signed[:, 1::2] << 4)).view(torch.int8).contiguous()
    scale, minimum = scale.float(), minimum.float()
    return packed, scale.t().contiguous(), (8 * scale - minimum).t().bfloat16().contiguous()


def build_zentorch_w4a8(w):
    return w4a8_state(*q4(w))


def call_zentorch_w4a8(state, x):
    packed, scales, zeros = state
    rows = x.shape[0]
    x = x.bfloat16() if rows > 1 else x.bfloat16().expand(2, -1).contiguous()   # its 1-row path is slow here
    y = torch.ops.zentorch.zentorch_dynamic_qlinear(x, packed, scales, None, is_weight_prepacked=False)
    sums = x.view(x.shape[0], -1, GROUP).float().sum(-1).bfloat16()
    return (y + sums @ zeros)[:rows]


def q4k_bytes(w):
    """w [N, K] -> a GGUF Q4_K tensor's bytes [N, K/256 * 144] (llama.cpp's layout: fp16 d and dmin,
    the 8 groups' 6-bit scales and minimums packed in 12 bytes, then the codes two a byte), rounded
    as q4() rounds, its group scales and minimums then on Q4_K's 6-bit grid under d and dmin."""
    import numpy as np
    n, k = w.shape
    g = w.double().numpy().reshape(-1, 8, GROUP)                                   # [blocks, 8, 32]
    lo = np.minimum(g.min(-1), 0.0)
    scale = np.maximum((g.max(-1) - lo) / 15, 1e-8)
    d = (scale.max(-1) / 63).astype(np.float16)
    dmin = ((-lo).max(-1) / 63).astype(np.float16)
    sc = np.clip(np.round(scale / np.maximum(d.astype(np.float64), 1e-12)[:, None]), 1, 63).astype(np.uint8)
    m = np.clip(np.round(-lo / np.maximum(dmin.astype(np.float64), 1e-12)[:, None]), 0, 63).astype(np.uint8)
    step = d.astype(np.float64)[:, None] * sc
    codes = np.clip(np.round((g + (dmin.astype(np.float64)[:, None] * m)[..., None]) / step[..., None]), 0, 15)
    codes = codes.astype(np.uint8)
    packed = np.zeros((g.shape[0], 12), dtype=np.uint8)
    packed[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    packed[:, 4:8] = m[:, 0:4] | ((m[:, 4:8] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:8] & 15) | ((m[:, 4:8] & 15) << 4)
    pairs = codes.reshape(-1, 4, 2, GROUP)                                         # 64 weights: low, then high
    qs = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)
    blocks = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), packed, qs], 1)
    return torch.from_numpy(blocks.reshape(n, -1).copy())


def build_ggml(w):
    """The weight as a GGUF Q4_K tensor (Q8_0 where K is not a multiple of Q4_K's 256, as GGUF
    files store such tensors), through llama.cpp's own kernels (specdec.runtime.ggml)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize
    n, k = w.shape
    if k % 256:
        blocks = torch.from_numpy(quantize(w.numpy(), GGMLQuantizationType.Q8_0).reshape(n, -1))
        return native_backends._ggml_prepare(blocks, int(GGMLQuantizationType.Q8_0), k)
    return native_backends._ggml_prepare(q4k_bytes(w), int(GGMLQuantizationType.Q4_K), k)


def call_ggml(state, x):
    return native_backends._ggml_run(state, x)


# CPU features a backend's kernels need (/proc/cpuinfo names), as the services' registry
# declares them: zentorch's int8 GEMMs end the process with SIGILL on a CPU without AVX-512
# VNNI, so they are skipped there (its W4A8 path shares the int8 one's needs).
NEEDS = {b.name: b.cpu_flags for b in kernels.BACKENDS}
NEEDS["zentorch-w4a8"] = NEEDS["zentorch-int8"]

def build_fbgemm_row(w):
    scales = (w.abs().amax(1).clamp(min=1e-8) / 127).float()
    return kernels._fbgemm_row_prepare(torch.round(w / scales[:, None]).to(torch.int8), scales)


def call_fbgemm_row(state, x):
    return kernels._fbgemm_row_run(state, x)


BACKENDS = {
    "torch-int4": (build_int4, call_int4),
    "fbgemm-int8": (build_fbgemm, call_fbgemm),
    "fbgemm-int8-row": (build_fbgemm_row, call_fbgemm_row),
    "torch-int8-wo": (build_int8_wo, call_int8_wo),
    "bf16": (build_bf16, call_bf16),
    "fp32": (build_fp32, call_fp32),
    "zentorch-int8": (build_zentorch, call_zentorch),
    "zentorch-w4a8": (build_zentorch_w4a8, call_zentorch_w4a8),
    "ggml": (build_ggml, call_ggml),
}


def bytes_of(state) -> int:
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, tuple):
        return sum(bytes_of(s) for s in state)
    return getattr(state, "nbytes", 0)


def measure(call, states, x, budget_s: float) -> float:
    for state in states[:2]:
        call(state, x)
    times, started, i = [], time.perf_counter(), 0
    while len(times) < 5 or (time.perf_counter() - started < budget_s and len(times) < 200):
        state = states[i % len(states)]
        i += 1
        t = time.perf_counter()
        call(state, x)
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--rows", default=",".join(map(str, ROWS)))
    p.add_argument("--backends", default=",".join(BACKENDS))
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--budget-s", type=float, default=0.3, help="time per cell, at least 5 calls")
    p.add_argument("--out", help="write the table as JSON here")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    l3 = l3_bytes()
    results, skipped = [], {}
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        torch.manual_seed(0)
        weight = torch.randn(n, k) * 0.02
        for name in args.backends.split(","):
            build, call = BACKENDS[name]
            x = torch.randn(4, k)
            missing = [flag for flag in NEEDS.get(name, ()) if flag not in kernels.cpu_flags()]
            if missing:
                if name not in skipped:
                    skipped[name] = f"this CPU lacks {', '.join(missing)}"
                    print(f"skipping {name}: {skipped[name]}", file=sys.stderr)
                continue
            try:
                first = build(weight)
                y = torch.as_tensor(call(first, x)).float()
                size = bytes_of(first)
                copies = min(max(1, -(-min(4 * l3, ROTATE_MAX) // size)), 64) if size else 1
                states = [first] + [build(weight) for _ in range(copies - 1)]
            except Exception as exc:  # not installed, or not for this CPU: skipped, said once
                if name not in skipped:
                    skipped[name] = f"{type(exc).__name__}: {exc}".splitlines()[0][:160]
                    print(f"skipping {name}: {skipped[name]}", file=sys.stderr)
                continue
            error = float((y - x @ weight.t()).norm() / (x @ weight.t()).norm())  # each kernel checked, not only timed
            cells = {}
            for m in rows:
                x = torch.randn(m, k)
                cells[m] = round(measure(call, states, x, args.budget_s), 4)
            results.append({"shape": shape, "backend": name, "ms": cells, "copies": len(states),
                            "relative_error": round(error, 5)})
            print(f"{shape:>12} {name:>14}: " + "  ".join(f"M={m}: {v:.3f}" for m, v in cells.items()),
                  file=sys.stderr, flush=True)
            del states, first
    print(f"\n{cpu()['model']}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"L3 {l3 / 2**20:.0f} MiB; ms, median\n")
    print("| weight (out × in) | kernel | " + " | ".join(f"M={m}" for m in rows) + " | rel. error |")
    print("|---|---|" + "---|" * len(rows) + "---|")
    for r in results:
        print(f"| {r['shape'].replace('x', ' × ')} | {r['backend']} | "
              + " | ".join(f"{r['ms'][m]:.3f}" for m in rows) + f" | {r['relative_error']:.4f} |")
    for name, why in skipped.items():
        print(f"\nskipped {name}: {why}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": {**cpu(), "threads": torch.get_num_threads(), "torch": torch.__version__,
                                   "l3_bytes": l3}, "rows": rows, "results": results, "skipped": skipped}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
