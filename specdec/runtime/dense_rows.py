"""Calls over many rows (a prefill): the path built for a few rows, or the one
built for many, whichever measured faster. Through a quantized layer that is its
kernel, or a dense matmul on the weight unpacked for the call (in bf16 or fp32,
whichever `matmul_dtype` measured faster here); in the lean
forward's attention, two batched matmuls, or torch's fused attention kernel.

The quantized kernels are built for decoding: torch's int4 CPU kernel takes 4
rows a pass, so its cost grows with the rows (a 1,024-token prefill of the 1.5B
took 10.1 s in int4 against about 3 in bf16), and the int8 layers (weight-only,
and fbgemm's dynamic GEMM with its int8 activations) do no better. Unpacking the weight costs a fixed few ms a layer, then the dense
matmul runs at the speed of its dtype; with the dense weights kept (`keep`, the services'
`--prefill-weights dense`), it is the matmul alone. Which is faster depends on the layer's shape, the
rows and the machine, so it is measured: the first call of each shape and
power-of-two row count times both (`kernel_choices.pick`) and remembers.

A call that keeps logits takes the kernel below MIN_ROWS, kept weight or not.
The dense weight is the kernel's weight in another rounding, so its logits are not
the kernel's: a verify call (γ + 1 rows) on it can pick another greedy token
than the decode step (one row, the kernel) would at a near tie, and speculative
greedy output would then differ from target-only, depending on which path timed
faster on that start. Decode, verification and batches of them all stay on the
kernel's arithmetic. A prefill chunk keeps no logits: it writes keys and values
that target-only and speculative requests read alike, so it takes whichever path
measured faster from 2 rows (a 40-token chat prompt ran at 21-26 ms a token
through the 1.5B's int4 kernel, against 13-17 timed). That holds per call, not per
forward: where a batched forward mixes calls (new prompts beside other sessions'
decode rows), each call's rows take the path they would take alone, the one its
own row bucket chose (`by_call`), so a session's logits and keys do not depend
on what else shares its forward.
"""
from __future__ import annotations

import functools
import logging
import time
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from specdec.runtime import kernel_choices

log = logging.getLogger(__name__)
MIN_ROWS = 64  # fewer rows in a call that keeps logits: always the kernel (decode and verify calls)
MIN_PREFILL_ROWS = 2  # one row: the kernel (its fastest path; a 1-row dense matmul runs oneDNN's GEMV, whose
#                       bits differ from the same row's in a matmul of more rows)
CHUNK_ROWS = 512  # rows unpacked at a time: a few MB of fp32, which stays in cache


def timed(rows: int, prefill: bool) -> bool:
    """Whether a call of `rows` may leave the kernel for the path its row bucket timed faster."""
    return rows >= MIN_ROWS or (prefill and rows >= MIN_PREFILL_ROWS)


def run(key: tuple, rows: int, few: Callable[[], torch.Tensor], many: Callable[[], torch.Tensor],
        names: tuple[str, str] = ("kernel", "dense"), kept: bool = False, prefill: bool = False) -> torch.Tensor:
    """few() or many(), the same result within roundings; `key` names the layer's shape.
    The choice is kernel_choices.pick's: timed TRIES times each (a first call pays one-off
    costs, such as oneDNN building its kernel for a new shape, that must not decide
    it), per row bucket, and reported with the other kernel choices. A call that
    is not `timed` (fewer than MIN_ROWS rows keeping logits) runs few()."""
    if not timed(rows, prefill):
        return few()
    return kernel_choices.pick(_key(key, kept), rows, dict(zip(names, (few, many))))


def _key(key: tuple, kept: bool) -> tuple:
    return (*key, "kept" if kept else "prefill")


_CALLS: list[tuple[list[int], list[bool]]] = []  # the forward running now (on the torch thread): its calls' rows,
#                                                    and which of them are prefill chunks


@contextmanager
def by_call(rows: Sequence[int], prefill: Sequence[bool] | None = None) -> Iterator[None]:
    """Within: the layers' inputs are these calls' rows, in order (a batched forward's);
    prefill[i]: call i is a prefill chunk (it keeps no logits)."""
    _CALLS.append((list(rows), list(prefill) if prefill is not None else [False] * len(rows)))
    try:
        yield
    finally:
        _CALLS.pop()


def run_rows(key: tuple, x: torch.Tensor, few: Callable[[torch.Tensor], torch.Tensor],
             many: Callable[[torch.Tensor], torch.Tensor], kept: bool = False) -> torch.Tensor:
    """A layer's output over x [rows, in] by `few` (its kernel) or `many` (dense), as
    `run` chooses; within `by_call`, each call's rows take the path that call would
    take alone: the kernel for a call that is not `timed`, else the choice of the
    call's own row bucket. The kernel's rows are gathered into one call (the
    kernels the target's rows take compute a row the same in a call of any rows);
    each dense call runs on its own rows, since a dense matmul's bits may change
    with its rows (oneDNN's bf16 matmul on an AMX Xeon changed kernel between 32
    and 56 rows, so eight 7-token prompts prefilled together wrote other keys
    than each alone, and greedy output under load left the one-client output);
    a call whose bucket is not timed yet is timed on its own rows."""
    rows = x.shape[0]
    calls, prefill = _CALLS[-1] if _CALLS and sum(_CALLS[-1][0]) == rows else ([rows], [False])
    if rows < MIN_ROWS and not any(prefill):  # every call keeps logits and is under it: the decode path, first
        return few(x)
    if len(calls) == 1:
        return run(key, rows, lambda: few(x), lambda: many(x), kept=kept, prefill=prefill[0])
    paths = [kernel_choices.chosen(_key(key, kept), n) if timed(n, p) else "kernel" for n, p in zip(calls, prefill)]
    if all(path == "kernel" for path in paths):
        return few(x)
    offsets = [0]
    for n in calls:
        offsets.append(offsets[-1] + n)
    pieces: list[tuple[torch.Tensor, torch.Tensor]] = []  # (row indices, their output)
    kernel_rows: list[torch.Tensor] = []
    for i, path in enumerate(paths):
        index = torch.arange(offsets[i], offsets[i + 1], device=x.device)
        if path == "kernel":
            kernel_rows.append(index)
            continue
        xi = x[offsets[i]:offsets[i + 1]]
        # "dense": on its own rows; None: the call's bucket not timed yet, timed on its rows alone.
        pieces.append((index, many(xi) if path == "dense" else
                       run(key, calls[i], lambda: few(xi), lambda: many(xi), kept=kept, prefill=True)))
    if kernel_rows:
        index = torch.cat(kernel_rows)
        pieces.append((index, few(x.index_select(0, index))))
    out = pieces[0][1].new_empty((rows, pieces[0][1].shape[-1]),
                                 dtype=functools.reduce(torch.promote_types, (y.dtype for _, y in pieces)))
    for index, y in pieces:
        out.index_copy_(0, index, y.to(out.dtype))
    return out


@functools.cache
def matmul_dtype() -> torch.dtype:
    """The dtype the dense path multiplies in: bf16 or fp32, whichever ran a prefill-sized
    matmul faster on this CPU (measured once per process). Where the CPU has bf16
    arithmetic (AVX-512 BF16, AMX) bf16 moves half the bytes; where it has none, torch
    emulates it and fp32 is several times faster (a 256-row 1536 x 8960 matmul took 329 ms
    in bf16 against 44 in fp32 on an AVX2 EPYC), and it is the exacter of the two."""
    x, w = torch.randn(128, 1024), torch.randn(1024, 1024)   # as `linear` multiplies: w is [out, in]
    best = {}
    for dtype in (torch.bfloat16, torch.float32):
        xd, wd = x.to(dtype), w.to(dtype)
        times = []
        for _ in range(4):                # the first call builds oneDNN's kernel: the fastest call counts
            started = time.perf_counter()
            F.linear(xd, wd)
            times.append(time.perf_counter() - started)
        best[dtype] = min(times)
    chosen = min(best, key=best.get)
    log.info("dense matmuls in %s (128 rows through a 1024 x 1024 weight: bf16 %.2f ms, fp32 %.2f ms)",
             str(chosen).removeprefix("torch."), best[torch.bfloat16] * 1e3, best[torch.float32] * 1e3)
    return chosen


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [rows, in] times a dense weight [out, in], in the weight's dtype (`matmul_dtype`'s):
    -> [rows, out] in x's dtype."""
    return F.linear(x.to(weight.dtype), weight).to(x.dtype)


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


def is_kept(module: nn.Module) -> bool:
    return "_kept_dense" in module.__dict__


def weight(module: nn.Module, build: Callable[[], object]) -> object:
    """A layer's dense weight for the many-rows path: the one `keep` made for it, else build()."""
    kept = module.__dict__.get("_kept_dense")
    return build() if kept is None else kept


def keep(roots) -> int:
    """Build and hold the dense weight of every layer in `roots` (and their
    submodules) that has one (`dense_weight`),
    so a prefill's matmuls stop unpacking: for the 1.5B in int4, 4.3 against 17.5 ms a
    prompt token on 256-token chunks here, for 2.7 GB held in bf16 (twice that where
    the dense path multiplies in fp32, `matmul_dtype`). Returns the bytes held.
    Made after loading, so the model cache (written by the load) never stores it."""
    held, seen = 0, set()
    for module in (m for root in roots for m in root.modules()):
        if id(module) in seen or not hasattr(module, "dense_weight"):
            continue
        seen.add(id(module))
        module.__dict__.pop("_kept_dense", None)
        dense = module.dense_weight()
        module.__dict__["_kept_dense"] = dense
        held += sum(t.numel() * t.element_size() for t in (dense if isinstance(dense, tuple) else (dense,))
                    if isinstance(t, torch.Tensor))
    return held
