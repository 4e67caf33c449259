"""Calls over many rows (a prefill): the path built for a few rows, or the one
built for many, whichever measured faster. Through a quantized layer that is its
kernel, or a dense bf16 matmul on the weight unpacked for the call; in the lean
forward's attention, two batched matmuls, or torch's fused attention kernel.

The quantized kernels are built for decoding: torch's int4 CPU kernel takes 4
rows a pass, so its cost grows with the rows (a 1,024-token prefill of the 1.5B
took 10.1 s in int4 against about 3 in bf16), and the int8 layers (weight-only,
and fbgemm's dynamic GEMM with its int8 activations) do no better. Unpacking the weight costs a fixed few ms a layer, then the dense
matmul runs at bf16 speed; with the dense weights kept (`keep`, the services'
`--prefill-weights dense`), it is the matmul alone. Which is faster depends on the layer's shape, the
rows and the machine, so it is measured: the first call of each shape and
power-of-two row count times both (`kernels.pick`) and remembers.

Below MIN_ROWS the kernel is always used, kept weight or not. The dense weight
is the kernel's weight rounded to bf16, so its logits are not the kernel's: a
verify call (γ + 1 rows) on it can pick another greedy token than the decode
step (one row, the kernel) would at a near tie, and speculative greedy output
would then differ from target-only, depending on which path timed faster on
that start. Decode, verification and batches of them all stay on the kernel's
arithmetic; only prefill-sized calls, whose keys and values both paths share,
may take the dense path. That holds per call, not per forward: where a batched
forward mixes calls of both kinds (a new prompt beside other sessions' decode
rows), each call's rows take the path they would take alone (`by_call`), so a
session's logits do not depend on what else shares its forward.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

import torch
from torch import nn

from specdec.runtime import kernels

MIN_ROWS = 64  # fewer rows: always the kernel (decode and verify calls, batches of them)
CHUNK_ROWS = 512  # rows unpacked at a time: a few MB of fp32, which stays in cache


def run(key: tuple, rows: int, few: Callable[[], torch.Tensor], many: Callable[[], torch.Tensor],
        names: tuple[str, str] = ("kernel", "dense"), kept: bool = False) -> torch.Tensor:
    """few() or many(), the same result within roundings; `key` names the layer's shape.
    The choice is kernels.pick's: timed TRIES times each (a first call pays one-off
    costs, such as oneDNN building its kernel for a new shape, that must not decide
    it), per row bucket, and reported with the other kernel choices."""
    if rows < MIN_ROWS:
        return few()
    return kernels.pick((*key, "kept" if kept else "prefill"), rows, dict(zip(names, (few, many))))


_CALLS: list[list[int]] = []  # the rows of each call in the forward running now (on the torch thread)


@contextmanager
def by_call(rows: Sequence[int]) -> Iterator[None]:
    """Within: the layers' inputs are these calls' rows, in order (a batched forward's)."""
    _CALLS.append(list(rows))
    try:
        yield
    finally:
        _CALLS.pop()


def run_rows(key: tuple, x: torch.Tensor, few: Callable[[torch.Tensor], torch.Tensor],
             many: Callable[[torch.Tensor], torch.Tensor], kept: bool = False) -> torch.Tensor:
    """A layer's output over x [rows, in] by `few` (its kernel) or `many` (dense), as
    `run` chooses; within `by_call`, the rows of each call take the path that call's
    rows would take alone: those of calls under MIN_ROWS the kernel, the others
    together the path timed for their count."""
    rows = x.shape[0]
    if rows < MIN_ROWS:  # every call under it too: the decode path, first
        return few(x)
    calls = _CALLS[-1] if _CALLS and sum(_CALLS[-1]) == rows else [rows]
    small = torch.tensor([n < MIN_ROWS for n in calls])
    if small.all():
        return few(x)
    if not small.any():
        return run(key, rows, lambda: few(x), lambda: many(x), kept=kept)
    in_small = torch.repeat_interleave(small, torch.tensor(calls))            # [rows]: the row's call is small
    small_rows, large_rows = in_small.nonzero()[:, 0].to(x.device), (~in_small).nonzero()[:, 0].to(x.device)
    large_x = x.index_select(0, large_rows)
    y_small = few(x.index_select(0, small_rows))
    y_large = run(key, large_x.shape[0], lambda: few(large_x), lambda: many(large_x), kept=kept)
    out = y_small.new_empty((rows, y_small.shape[-1]), dtype=torch.promote_types(y_small.dtype, y_large.dtype))
    return out.index_copy_(0, small_rows, y_small.to(out.dtype)).index_copy_(0, large_rows, y_large.to(out.dtype))


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
    prompt token on 256-token chunks here, for 2.7 GB held. Returns the bytes held.
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
