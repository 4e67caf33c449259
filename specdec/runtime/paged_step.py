"""One forward step at static shapes over the KV arena: the CUDA path's step,
written as gpt-fast and vLLM write theirs, and run on the CPU in the tests.

`PagedStep` is the arithmetic alone. It takes a fixed number of rows (a bucket),
each with its token id, its position and its session's block table, and every
tensor's shape is set by the bucket and the arena: nothing is read back to the
host, no Python branch looks at a value, so one CUDA graph a bucket replays it.
Per layer: norm, q/k/v (one GEMM where the weights are plain Linear), rotary
from a table, each row's key and value written to its slot in the arena,
attention over the row's pages gathered (SDPA under a mask of the row's
positions: a verification's rows see each other's keys, written before), o,
gate/up (one GEMM), down. Padding rows (id 0, position 0, a table of the
scratch page) write only the scratch page and read only it: real rows get the
same logits whatever padding shares their step.

`PagedRunner` is the host's side: persistent input buffers per bucket at fixed
addresses, filled from pinned memory by non-blocking copies; a call's rows
padded to its bucket; on CUDA the bucket's graph, captured at warm-up
(`capture`), replayed. A bucket has two graphs past one row: rows of several
sessions, each gathering its own pages, and one session's rows (a verification,
a chunk), which gather its pages once for all of them (k rows of one session
would otherwise read its keys and values k times). With `compile` the step is
`torch.compile`d whole, once a graph at static shapes (gpt-fast's decode step),
before the graph is captured: the norms, rotary and activations fuse, and an
INT8 weight's cast folds into its matmul (quant.int8_device).
"""
from __future__ import annotations

import os
import shutil
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from specdec.rpc.errors import InvalidArgument
from specdec.runtime.device import policy
from specdec.runtime.kv_arena import KVArena, PagedSequence
from specdec.runtime.decoder_layer import rms_norm, rotate, signed_sin
from specdec.runtime.lean import LeanForward

# Row buckets a runner captures: decode batches, and verifications of γ + 1 rows fall in them.
BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def fused_linear(modules: Sequence[nn.Module]) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """One GEMM for several plain Linear layers side by side (q/k/v, gate/up), or None where
    they are not all plain Linear (a quantized kind fuses itself: quant.base.fuse). The
    layers' weights become views of the fused one, so the model holds one copy."""
    if not modules or not all(type(m) is nn.Linear for m in modules):
        return None
    with torch.no_grad():
        weight = torch.cat([m.weight for m in modules])
        biased = any(m.bias is not None for m in modules)
        bias = torch.cat([m.bias if m.bias is not None else m.weight.new_zeros(m.out_features)
                          for m in modules]) if biased else None
        start = 0
        for m in modules:
            m.weight = nn.Parameter(weight[start:start + m.out_features], requires_grad=False)
            if m.bias is not None:
                m.bias = nn.Parameter(bias[start:start + m.out_features], requires_grad=False)
            start += m.out_features
    return lambda h: F.linear(h, weight, bias)


@dataclass
class _StepLayer:
    input_norm: nn.Module
    post_norm: nn.Module
    qkv: Callable[[torch.Tensor], torch.Tensor]
    o_proj: nn.Module
    gate_up: Callable[[torch.Tensor], torch.Tensor] | None
    mlp: nn.Module


class PagedStep:
    """logits [R, vocab] fp32 = step(ids [R], positions [R], tables [R, max_pages]), keys and values
    written into the arena at each row's slot."""

    def __init__(self, forward: LeanForward, arena: KVArena, max_pages: int):
        self.forward, self.arena, self.max_pages = forward, arena, max_pages
        self.heads, self.kv_heads, self.head_dim = forward.heads, forward.kv_heads, forward.head_dim
        device, pages = arena.keys.device, arena.page_tokens
        self.layers = []
        for layer in forward.layers:
            attn_parts = [layer.q_proj, layer.k_proj, layer.v_proj]
            qkv = fused_linear(attn_parts) or layer.qkv or \
                (lambda h, parts=attn_parts: torch.cat([p(h) for p in parts], dim=-1))
            gate_up = fused_linear([getattr(layer.mlp, "gate_proj", None), getattr(layer.mlp, "up_proj", None)]) \
                if hasattr(layer.mlp, "gate_proj") else None
            self.layers.append(_StepLayer(layer.input_norm, layer.post_norm, qkv, layer.o_proj,
                                          gate_up or layer.gate_up, layer.mlp))
        # Rotary by position, computed once for every position a table can reach (gpt-fast's freqs_cis).
        self.key_positions = torch.arange(max_pages * pages, device=device)            # [L]
        like = torch.empty(1, 1, 1, dtype=forward.dtype, device=device)
        cos, sin = forward.rotary(like, self.key_positions[None])
        self.cos, self.sin = cos[0], signed_sin(sin[0])                                # [L, dim]
        self.page_offsets = torch.arange(pages, device=device)                           # [page]

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor,
                 shared: bool = False) -> torch.Tensor:
        """`tables` [R, pages]: as many pages as the call's context bucket needs (at most
        max_pages). `shared`: the rows are one sequence's from row 0 (a verification, a prefill
        chunk), padding rows after them, and its context is gathered once for all of them, not
        once a row."""
        rows, heads, kv_heads, dim = ids.shape[0], self.heads, self.kv_heads, self.head_dim
        page = self.arena.page_tokens
        q_size, kv_size = heads * dim, kv_heads * dim
        x = self.forward.embed(ids)                                                     # [R, hidden]
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]           # [R, 1, dim]
        # Each row's slot in the arena, and the slots of every position its table covers.
        slots = tables.gather(1, torch.div(positions, page, rounding_mode="floor")[:, None])[:, 0] * page \
            + positions % page                                                          # [R]
        readers = tables[:1] if shared else tables                                      # [B, pages]: B = 1 or R
        context = (readers[:, :, None] * page + self.page_offsets).reshape(readers.shape[0], -1)   # [B, L]
        length = context.shape[1]
        visible = self.key_positions[None, :length] <= positions[:, None]              # [R, L]
        mask = visible[None, None] if shared else visible[:, None, None, :]            # [B, 1, R or 1, L]
        keys_all, values_all = self.arena.keys, self.arena.values
        for i, layer in enumerate(self.layers):
            qkv = layer.qkv(rms_norm(layer.input_norm, x))                             # [R, q + 2 kv]
            qk = rotate(qkv[:, :q_size + kv_size].view(rows, heads + kv_heads, dim), cos, sin)
            # Written through the arena tensor itself, not a view of it (keys_all[i]): inductor
            # turns an index_put_ on a compiled step's input back into an in-place write, but a
            # write through a view it leaves functional, which copied the whole arena every step.
            slot = (torch.full_like(slots, i), slots)
            keys_all.index_put_(slot, qk[:, heads:].to(keys_all.dtype))
            values_all.index_put_(slot, qkv[:, q_size + kv_size:].view(rows, kv_heads, dim).to(values_all.dtype))
            keys = keys_all[i][context].transpose(1, 2)                                 # [B, kv_heads, L, dim]
            values = values_all[i][context].transpose(1, 2)
            q = qk[:, :heads].transpose(0, 1)[None] if shared else qk[:, :heads, None]  # [B, heads, R or 1, dim]
            out = F.scaled_dot_product_attention(q.to(keys.dtype), keys, values, attn_mask=mask, enable_gqa=True)
            out = out[0].transpose(0, 1) if shared else out[:, :, 0]                   # [R, heads, dim]
            x = x + layer.o_proj(out.reshape(rows, q_size).to(x.dtype))
            h = rms_norm(layer.post_norm, x)
            if layer.gate_up is None:
                x = x + layer.mlp(h)
            else:
                gate, up = layer.gate_up(h).chunk(2, dim=-1)
                x = x + layer.mlp.down_proj(layer.mlp.act_fn(gate) * up)
        return self.forward.lm_head(rms_norm(self.forward.norm, x)).float()


def toolchain_missing(backend: str, device: torch.device) -> list[str]:
    """What `torch.compile(backend=...)` needs on `device` and this machine lacks ([]: nothing).
    Inductor compiles what it writes: C++ on the CPU (a compiler found by inductor's own
    search, `cpp.cxx`), Triton kernels on a GPU (Triton's launcher is built by a C compiler,
    CC or gcc or clang as Triton looks for them, against Python's headers). Checked before a
    model loads, so a service that lacks one says so at start, not in its first warm-up."""
    if backend != "inductor":
        return []
    missing = []
    if device.type == "cpu":
        from torch._inductor import config
        candidates = [cxx for cxx in config.cpp.cxx if cxx] if isinstance(config.cpp.cxx, (list, tuple)) \
            else [config.cpp.cxx]
        if not any(shutil.which(cxx) for cxx in candidates):
            missing.append(f"a C++ compiler ({' or '.join(candidates)} on PATH, or CXX; e.g. the g++ package)")
        return missing
    try:
        import triton  # noqa: F401 (torch's CUDA wheels bring it)
    except ImportError:
        missing.append("Triton (the triton package torch's CUDA wheels depend on)")
    if not (os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")):
        missing.append("a C compiler for Triton's launcher (gcc or clang on PATH, or CC; e.g. the gcc package)")
    scheme = sysconfig.get_default_scheme()
    include = sysconfig.get_paths(scheme="posix_prefix" if scheme == "posix_local" else scheme)["include"]
    if not (Path(include) / "Python.h").is_file():
        missing.append(f"Python's headers ({include}/Python.h; e.g. the python3-dev package)")
    return missing


class PagedRunner:
    """Calls of several sessions' rows through the static step: padded to a row bucket, their
    tables cut to a context bucket (a power of two of pages: attention reads what the
    longest session needs, not the tables' whole reach). A call of more rows than the
    largest bucket (a prefill chunk) runs eager, one sequence at a time."""

    def __init__(self, forward: LeanForward, arena: KVArena, max_context: int,
                 buckets: Sequence[int] = BUCKETS, graphs: bool | None = None, compile: str | None = None):
        self.arena = arena
        self.max_pages = -(-max_context // arena.page_tokens)
        self.max_context = self.max_pages * arena.page_tokens
        self.step = PagedStep(forward, arena, self.max_pages)
        self.buckets = sorted(set(buckets))
        # `compile`: the backend ("inductor" on a GPU). One compile a row bucket, its rows static:
        # a dynamic row count would leave each matmul to an extern kernel over a weight cast
        # whole first. The context is dynamic, so a session growing past a context bucket
        # captures a graph, not compiles again (tens of seconds on a GPU, mid-request).
        # Prefill chunks (many rows, `shared`) stay eager.
        self._bucket_step = self.step
        if compile:
            # The limit counts every compile of PagedStep.__call__ in the process, and each runner's
            # step is another instance of it (the check's models, two models in one process).
            config = torch._dynamo.config   # cache_size_limit before torch 2.6
            name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
            setattr(config, name, getattr(config, name) + 2 * len(self.buckets))   # shared and not
            # gpt-fast's setting: inductor then writes a 1-row matmul (a draft step, a decode) as
            # a reduction on a GPU, which an INT8 weight's cast folds into; otherwise cuBLAS runs
            # it over the weight cast to bf16 first, and INT8 reads more than bf16 would.
            options = {"coordinate_descent_tuning": True} if compile == "inductor" else None
            compiled = torch.compile(self.step, backend=compile, fullgraph=True, options=options)

            def bucket_step(ids: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor,
                            shared: bool = False) -> torch.Tensor:
                for tensor in (ids, positions, tables):
                    torch._dynamo.mark_static(tensor, 0)
                torch._dynamo.mark_dynamic(tables, 1)
                return compiled(ids, positions, tables, shared)
            self._bucket_step = bucket_step
        self.device = device = arena.keys.device
        self.graphs = policy(device).graphs if graphs is None else graphs
        self._pinned = policy(device).graphs   # staged for the graphs' buffers by non-blocking copies

        # A bucket's inputs in one buffer, [2 + max_pages, rows]: the rows' ids, their positions, then
        # their block tables by column. A call fills the part its context bucket reads (through numpy)
        # and copies it in one piece; the step reads views of it, the tables' [rows, pages] strided
        # alike whatever the bucket (a contiguous widest bucket would compile again).
        height = 2 + self.max_pages
        self._inputs = {rows: torch.zeros((height, rows), dtype=torch.long, device=device) for rows in self.buckets}
        self._staging = {rows: torch.zeros((height, rows), dtype=torch.long, pin_memory=self._pinned)
                         for rows in self.buckets}
        self._copied = {rows: torch.cuda.Event() if self._pinned else None for rows in self.buckets}
        # (rows, pages, shared) -> the graph and its output
        self._graphs: dict[tuple[int, int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None

    def bucket(self, rows: int) -> int:
        for size in self.buckets:
            if size >= rows:
                return size
        raise InvalidArgument(f"{rows} rows in one step; the largest bucket is {self.buckets[-1]}: "
                              "split the call")

    def context_pages(self, positions: int) -> int:
        """The context bucket for `positions`: pages, a power of two (at least 16), at most max_pages."""
        pages = max(1, -(-positions // self.arena.page_tokens))
        return min(max(16, 1 << (pages - 1).bit_length()), self.max_pages)

    def _inputs_for(self, rows: int, pages: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        packed = self._inputs[rows]
        return packed[0], packed[1], packed[2:2 + pages].t()

    @torch.inference_mode()
    def capture(self, context: int | None = None) -> None:
        """CUDA graphs of the step for every row bucket at the context bucket of `context`
        positions (default the smallest), largest first, in one memory pool: warmed up on a
        side stream, captured over the persistent inputs (all padding now). Other context
        buckets are captured when a call first needs them."""
        if not self.graphs:
            return
        pages = self.context_pages(context or 1)
        for rows in sorted(self.buckets, reverse=True):
            for shared in {False, self._shared(rows, 1)}:
                self._capture(rows, pages, shared)
        torch.cuda.synchronize()

    @staticmethod
    def _shared(rows: int, calls: int) -> bool:
        """Whether a bucket's step gathers one context for all its rows: one call's rows (padding
        rows then read that context at position 0, and write only the scratch page)."""
        return calls == 1 and rows > 1

    def _capture(self, rows: int, pages: int, shared: bool) -> None:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        inputs = self._inputs_for(rows, pages)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._bucket_step(*inputs, shared)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self._bucket_step(*inputs, shared)
        self._graphs[(rows, pages, shared)] = (graph, out)

    @torch.inference_mode()
    def forward(self, items: Sequence[tuple[Sequence[int] | torch.Tensor, PagedSequence, int]]) -> list[torch.Tensor]:
        """[(token ids, sequence, rows kept)] -> [logits [kept, vocab] fp32], each sequence
        advanced by its ids: the host's, or a tensor on the device (copied into the step's
        buffer there, never read back). The logits are the device's: read them before the next call."""
        for ids, sequence, keep in items:
            assert len(ids) and 0 <= keep <= len(ids), (len(ids), keep)
            if sequence.length + len(ids) > self.max_context:
                raise InvalidArgument(f"{sequence.length + len(ids)} positions; this runner's tables reach "
                                      f"{self.max_context}")
        for ids, sequence, _ in items:
            self.arena.reserve(sequence, sequence.length + len(ids))
        # Fewest rows first, packed into groups that fit the largest bucket; a call past it alone, eager.
        out: list[torch.Tensor | None] = [None] * len(items)
        group, rows = [], 0
        for j in sorted(range(len(items)), key=lambda j: len(items[j][0])) + [None]:
            n = len(items[j][0]) if j is not None else 0
            if j is not None and n > self.buckets[-1]:
                out[j] = self._eager(*items[j])
                continue
            if group and (j is None or rows + n > self.buckets[-1]):
                for k, logits in zip(group, self._bucketed([items[k] for k in group])):
                    out[k] = logits
                group, rows = [], 0
            if j is not None:
                group.append(j)
                rows += n
        return out

    def _bucketed(self, items: Sequence[tuple[Sequence[int] | torch.Tensor, PagedSequence, int]]) -> list[torch.Tensor]:
        rows = sum(len(ids) for ids, _, _ in items)
        size = self.bucket(rows)
        shared = self._shared(size, len(items))
        pages = self.context_pages(max(sequence.length + len(ids) for ids, sequence, _ in items))
        if self._copied[size] is not None:
            self._copied[size].synchronize()   # the last copy out of this staging has landed
        read = 2 + pages                       # the buffer's rows this call's step reads
        staged = self._staging[size][:read].numpy()
        staged.fill(0)                         # padding: id 0 at position 0 over the scratch page
        kept, on_device, row = [], [], 0
        for ids, sequence, keep in items:
            end = row + len(ids)
            if isinstance(ids, torch.Tensor):  # decided on the device (a chained step): copied there, below
                on_device.append((row, end, ids))
            else:
                staged[0, row:end] = ids
            staged[1, row:end] = np.arange(sequence.length, sequence.length + len(ids))
            table = sequence.pages[:pages]     # a rollback keeps pages past the context it reads
            staged[2:2 + len(table), row:end] = np.asarray(table)[:, None]
            kept.append((end - keep, end))
            row = end
        self._inputs[size][:read].copy_(self._staging[size][:read], non_blocking=True)
        if self._copied[size] is not None:
            self._copied[size].record()
        for lo, hi, ids in on_device:
            self._inputs[size][0, lo:hi].copy_(ids)
        key = (size, pages, shared)
        if self.graphs and key not in self._graphs:
            self._capture(*key)
        if key in self._graphs:
            graph, logits = self._graphs[key]
            graph.replay()
        else:
            logits = self._bucket_step(*self._inputs_for(size, pages), shared)
        for ids, sequence, _ in items:
            sequence.length += len(ids)
        logits = logits[:rows].clone()   # the graph's output is overwritten by the next replay
        return [logits[lo:hi] for lo, hi in kept]

    def _eager(self, ids: Sequence[int], sequence: PagedSequence, keep: int) -> torch.Tensor:
        """One sequence's many rows (a prefill chunk), at their own count, its context gathered once."""
        rows = len(ids)
        pages = self.context_pages(sequence.length + rows)
        table = torch.zeros(pages, dtype=torch.long)
        table[:len(sequence.pages)] = torch.tensor(sequence.pages)
        inputs = (ids if isinstance(ids, torch.Tensor) else torch.tensor(list(ids)),
                  torch.arange(sequence.length, sequence.length + rows),
                  table[None].expand(rows, pages))
        inputs = tuple(t.to(self.device, non_blocking=self._pinned) for t in inputs)
        logits = self.step(*inputs, shared=True)
        sequence.length += rows
        return logits[rows - keep:]
