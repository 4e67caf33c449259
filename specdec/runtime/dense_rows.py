"""Calls over many rows (a prefill): the path built for a few rows, or the one
built for many, whichever measured faster. Through a quantized layer that is its
kernel, or a dense bf16 matmul on the weight unpacked for the call; in the lean
forward's attention, two batched matmuls, or torch's fused attention kernel.

The quantized kernels are built for decoding: torch's int4 CPU kernel takes 4
rows a pass, so its cost grows with the rows (a 1,024-token prefill of the 1.5B
took 10.1 s in int4 against about 3 in bf16), and the int8 layers (weight-only,
and fbgemm's dynamic GEMM with its int8 activations) do no better. Unpacking the weight costs a fixed few ms a layer, then the dense
matmul runs at bf16 speed. Which is faster depends on the layer's shape, the
rows and the machine, so it is measured: the first call of each shape and
power-of-two row count runs both and remembers. Below MIN_ROWS the kernel is
always used, so decode and verify calls (γ + 1 rows) never ask.
"""
from __future__ import annotations

import time
from typing import Callable

import torch

MIN_ROWS = 64
CHUNK_ROWS = 512  # rows unpacked at a time: a few MB of fp32, which stays in cache

# (*key, rows.bit_length()) -> whether the path for many rows measured faster
_CHOICE: dict[tuple, bool] = {}


def run(key: tuple, rows: int, few: Callable[[], torch.Tensor], many: Callable[[], torch.Tensor]) -> torch.Tensor:
    """few() or many(), the same result within roundings; `key` names the layer's shape."""
    if rows < MIN_ROWS:
        return few()
    key = (*key, rows.bit_length())
    choice = _CHOICE.get(key)
    if choice is not None:
        return many() if choice else few()
    started = time.perf_counter()
    many_out = many()
    many_s = time.perf_counter() - started
    few_out = few()
    _CHOICE[key] = many_s < time.perf_counter() - started - many_s
    return many_out if _CHOICE[key] else few_out


def unpack(rows: int, cols: int, dtype: torch.dtype,
           chunk: Callable[[int, int], torch.Tensor]) -> torch.Tensor:
    """[rows, cols] in `dtype`, filled CHUNK_ROWS at a time from chunk(start, end)
    (fp32): in cache-sized pieces the unpacking took a tenth of the time of whole
    passes over the weight (2.5 against 27 ms for a 1536 x 8960 int4 weight here)."""
    out = torch.empty(rows, cols, dtype=dtype)
    for start in range(0, rows, CHUNK_ROWS):
        end = min(start + CHUNK_ROWS, rows)
        out[start:end] = chunk(start, end)
    return out
