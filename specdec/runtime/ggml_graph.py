"""The lean forward's decode and verify calls as one ggml graph: llama.cpp's design.

Through torch, a one-row step of the 1.5B int4 target runs about 50 small ops a
layer besides its matmuls (norms, rotary, the cache writes, attention, residuals,
dtype conversions), each a Python call and an OpenMP dispatch: on an AVX2 EPYC
they took about 21 of a 75 ms step, where ggml's matmuls took 54 and llama.cpp's
whole step 54. Here every layer is built as ggml nodes over the GGUF's blocks,
the session's own KV cache and fp32 activations, and computed in one call:

    x -> per layer: rms_norm * w, q/k/v (+ bias), rope (NeoX, as the Hugging Face
    weights are laid out), write K/V at each row's position, attention of each row
    over its own prefix (ggml's flash attention), o, residual, rms_norm * w,
    swiglu(gate, up), down, residual -> final norm and LM head on the rows kept.

A verification's rows must come out as the decode steps', bit for bit. Each node
works on a row alone (norms, rope, the element-wise ops), each row's attention is
its own node over its own prefix, and the matmuls run at most ggml.CHUNK_ROWS rows
a graph (ggml.REPACK_ROWS where weights are repacked), where a row's
result does not depend on the rows beside it: a call of more rows is several
graphs in turn. `ggml_forward.check` proves it on the model at hand
before a service uses the path (ggml_forward chooses it by timing).
"""
from __future__ import annotations

import ctypes
import functools
import logging
import math

import torch
from torch import nn

from specdec.runtime import ggml

log = logging.getLogger(__name__)
F32, I32 = 0, 26      # ggml types
ROPE_NEOX = 2
_p, _i64, _size, _f = ctypes.c_void_p, ctypes.c_int64, ctypes.c_size_t, ctypes.c_float


class Unsupported(Exception):
    """The model cannot run as a ggml graph here (the reason, for the log)."""


class _Api:
    """The graph-building functions of ggml, bound once per process."""

    def __init__(self):
        g = ggml.lib()
        self.g = g

        def bind(name, args, result=_p):
            fn = getattr(g.base, name)
            fn.argtypes, fn.restype = args, result
            setattr(self, name.removeprefix("ggml_"), fn)
        bind("ggml_new_tensor_1d", [_p, ctypes.c_int, _i64])
        bind("ggml_new_tensor_2d", [_p, ctypes.c_int, _i64, _i64])
        bind("ggml_new_tensor_4d", [_p, ctypes.c_int, _i64, _i64, _i64, _i64])
        bind("ggml_view_2d", [_p, _p, _i64, _i64, _size, _size])
        bind("ggml_view_3d", [_p, _p, _i64, _i64, _i64, _size, _size, _size])
        bind("ggml_reshape_3d", [_p, _p, _i64, _i64, _i64])
        bind("ggml_cpy", [_p, _p, _p])
        bind("ggml_add", [_p, _p, _p])
        bind("ggml_mul", [_p, _p, _p])
        bind("ggml_rms_norm", [_p, _p, _f])
        bind("ggml_mul_mat", [_p, _p, _p])
        bind("ggml_swiglu_split", [_p, _p, _p])
        bind("ggml_get_rows", [_p, _p, _p])
        bind("ggml_rope_ext", [_p, _p, _p, _p, ctypes.c_int, ctypes.c_int, ctypes.c_int, _f, _f, _f, _f, _f, _f])
        bind("ggml_flash_attn_ext", [_p, _p, _p, _p, _p, _f, _f, _f])
        bind("ggml_get_data", [_p])
        bind("ggml_build_forward_expand", [_p, _p], None)


@functools.cache
def api() -> _Api:
    return _Api()


class _Weight:
    """One projection's GGUF blocks as a ggml tensor (held for the process), and its bias in fp32."""

    def __init__(self, module: nn.Module, rows: slice | None = None):
        blocks = getattr(module, "gguf_blocks", None)
        if blocks is None:
            raise Unsupported(f"a {type(module).__name__} without GGUF blocks")
        bias = getattr(module, "bias", None)
        if rows is not None:
            blocks, bias = blocks[rows], None if bias is None else bias[rows]
        self.blocks = ggml.aligned(blocks)
        self.in_features, self.out_features = module.in_features, self.blocks.shape[0]
        self.ggml_type = int(module.ggml_type)
        self.bias = None if bias is None else ggml.aligned(bias.detach().float())


def _norm_weight(norm: nn.Module) -> torch.Tensor:
    return ggml.aligned(norm.weight.detach().float())


class _Layer:
    def __init__(self, layer) -> None:   # a specdec.runtime.decoder_layer.Layer
        if layer.qkv is not None:
            q, kv = layer.q_size, layer.kv_size
            self.q, self.k, self.v = (_Weight(layer.qkv, s) for s in (slice(0, q), slice(q, q + kv),
                                                                         slice(q + kv, q + 2 * kv)))
        else:
            self.q, self.k, self.v = _Weight(layer.q_proj), _Weight(layer.k_proj), _Weight(layer.v_proj)
        self.o = _Weight(layer.o_proj)
        mlp = layer.mlp
        if layer.gate_up is not None:
            n = layer.gate_up.out_features // 2
            self.gate, self.up = _Weight(layer.gate_up, slice(0, n)), _Weight(layer.gate_up, slice(n, 2 * n))
        elif all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
            self.gate, self.up = _Weight(mlp.gate_proj), _Weight(mlp.up_proj)
        else:
            raise Unsupported(f"an MLP of kind {type(mlp).__name__}")
        if getattr(mlp, "act_fn", None).__class__.__name__ not in ("SiLU", "SiLUActivation"):
            raise Unsupported(f"an MLP activation other than SiLU ({type(getattr(mlp, 'act_fn', None)).__name__})")
        self.down = _Weight(mlp.down_proj)
        self.input_norm, self.post_norm = _norm_weight(layer.input_norm), _norm_weight(layer.post_norm)
        self.eps = float(layer.input_norm.variance_epsilon)


def _rope_base(lean) -> float:
    """The rotary's base, where the model's rotary is the plain one ggml's rope computes."""
    rotary, config = lean.rotary, lean.config
    if getattr(rotary, "rope_type", "default") != "default" or getattr(rotary, "attention_scaling", 1.0) != 1.0:
        raise Unsupported(f"rotary embedding of type {getattr(rotary, 'rope_type', '?')!r}")
    base = getattr(config, "rope_theta", None)
    if base is None:
        base = (getattr(config, "rope_parameters", None) or {}).get("rope_theta")
    dim = lean.head_dim
    if base is None or rotary.inv_freq.shape[0] * 2 != dim:
        raise Unsupported("a partial or unknown rotary embedding")
    want = 1.0 / (float(base) ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if not torch.allclose(rotary.inv_freq.double().cpu(), want, rtol=1e-5):
        raise Unsupported("a rotary embedding whose frequencies are not base^(-2i/d)")
    return float(base)


class GraphForward:
    """A LeanForward's weights as ggml tensors; `rows` runs a call's rows as graphs."""

    def __init__(self, lean) -> None:   # a specdec.runtime.lean.LeanForward on the CPU
        if lean.embed.weight.device.type != "cpu":
            raise Unsupported("not on the CPU")
        self.lean = lean
        self.base = _rope_base(lean)
        self.layers = [_Layer(layer) for layer in lean.layers]
        # A head cut to some ids (a draft's) computes those rows; its `scatter` sets the others to -inf.
        self.restricted = lean.lm_head if hasattr(lean.lm_head, "keep_ids") else None
        self.head = _Weight(lean.lm_head if self.restricted is None else lean.lm_head.head)
        self.norm = _norm_weight(lean.norm)
        self.eps = float(lean.norm.variance_epsilon)
        self.heads, self.kv_heads, self.dim = lean.heads, lean.kv_heads, lean.head_dim
        self.hidden = lean.embed.weight.shape[1]
        self.n_ctx = int(getattr(lean.config, "max_position_embeddings", 0) or 0)
        self._ctx = None
        self._arena = torch.empty(0, dtype=torch.uint8)
        self.chunk_rows = ggml.CHUNK_ROWS   # rows a graph, at most
        self.repacked = 0                   # weights laid out for ggml's repacked kernels

    def place(self, repack: bool = False) -> None:
        """Make the weights' ggml headers (loads ggml: only where its backend runs here); with
        `repack`, the Q4_K and Q4_0 weights in ggml's repack layout where their type passes its
        probe (a copy: the blocks stay torch's)."""
        a = api()
        # The weights' headers, for the process's life, over the blocks and norms held here.
        held = [t for layer in self.layers for t in (layer.input_norm, layer.post_norm)] + [self.norm]
        weights = [w for layer in self.layers for w in (layer.q, layer.k, layer.v, layer.o, layer.gate,
                                                       layer.up, layer.down)] + [self.head]
        biases = [w for w in weights if w.bias is not None]
        count = len(held) + len(weights) + len(biases)
        self._ctx = a.g.init(ggml._InitParams(count * a.g.tensor_overhead() + 1024, None, True))
        self._buffers = []
        self._tensor: dict[int, int] = {}   # id(torch tensor) -> its ggml tensor
        for t in held + [w.bias for w in biases]:
            self._put(a.new_tensor_1d(self._ctx, F32, t.shape[0]), t)
        for w in weights:
            tensor = a.new_tensor_2d(self._ctx, w.ggml_type, w.in_features, w.out_features)
            if repack and ggml.repackable(w.ggml_type, w.out_features):
                self._buffers.append(ggml.place_repacked(tensor, w.blocks))
                self._tensor[id(w.blocks)] = tensor
                self.repacked += 1
            else:
                self._put(tensor, w.blocks)
        if self.repacked:
            self.chunk_rows = ggml.REPACK_ROWS

    def _put(self, tensor, memory: torch.Tensor) -> None:
        self._buffers.append(ggml.place(tensor, memory))
        self._tensor[id(memory)] = tensor

    def __del__(self):
        if getattr(self, "_ctx", None) is not None:
            g = api().g
            for buffer in self._buffers:
                g.buffer_free(buffer)
            g.free(self._ctx)

    def _nodes(self, rows: int) -> int:
        """A graph's node budget for `rows` rows: some 40 a layer, 12 more a row (its cache writes and attention)."""
        return len(self.layers) * (40 + 12 * rows) + 64

    def _arena_bytes(self, rows: int, caches: int) -> int:
        """Memory for one graph's nodes and their results (fp32), with room to spare."""
        layer = self.layers[0]
        floats = 12 * self.hidden + 6 * (layer.q.out_features + 2 * layer.k.out_features) + 4 * layer.gate.out_features
        nodes = self._nodes(rows) + caches
        overhead = api().g.tensor_overhead()
        return (rows * len(self.layers) * floats * 4 + nodes * overhead + api().g.graph_overhead(4 * nodes, False)
                + self.head.out_features * rows * 4 + (1 << 20))

    def rows(self, x: torch.Tensor, caches: list, positions: list[int], kept: list[int]) -> torch.Tensor:
        """x [R, hidden] (R <= self.chunk_rows), row r at positions[r] of caches[r] (a
        StaticKVCache holding at least that position's room) -> logits [len(kept), vocab]
        float32 of the rows `kept` (indices into R); writes each row's keys and values."""
        rows = x.shape[0]
        assert 0 < rows <= self.chunk_rows and len(caches) == len(positions) == rows, (x.shape, positions)
        assert x.shape[1] == self.hidden, x.shape
        a, g = api(), api().g
        distinct = list({id(c): c for c in caches}.values())
        size = self._arena_bytes(rows, len(distinct))
        if self._arena.numel() < size:
            self._arena = torch.empty(size, dtype=torch.uint8)
        ctx = g.init(ggml._InitParams(size, self._arena.data_ptr(), False))
        cache_ctx = g.init(ggml._InitParams(len(distinct) * g.tensor_overhead() + 1024, None, True))
        buffers = []
        try:
            cache_tensor = {}
            for cache in distinct:
                buf = cache.buffer
                assert buf.dtype == torch.float32 and buf.is_contiguous(), (buf.dtype, buf.stride())
                layers, two, kv_heads, capacity, dim = buf.shape
                t = a.new_tensor_4d(cache_ctx, F32, dim, capacity, kv_heads, layers * two)
                buffers.append(ggml.place(t, buf))
                cache_tensor[id(cache)] = (t, capacity)
            logits = self._build_and_run(ctx, x, caches, positions, kept, cache_tensor)
        finally:
            for buffer in buffers:
                g.buffer_free(buffer)
            g.free(cache_ctx)
            g.free(ctx)
        return logits

    def _build_and_run(self, ctx, x, caches, positions, kept, cache_tensor) -> torch.Tensor:
        a, g = api(), api().g
        T = self._tensor
        rows, heads, kv_heads, dim = x.shape[0], self.heads, self.kv_heads, self.dim
        q_size, kv_size, f = heads * dim, kv_heads * dim, 4
        graph = g.new_graph(ctx, self._nodes(rows), False)
        h_in = a.new_tensor_2d(ctx, F32, self.hidden, rows)
        pos = a.new_tensor_1d(ctx, I32, rows)
        hidden = h_in

        def linear(w: _Weight, h):
            y = a.mul_mat(ctx, T[id(w.blocks)], h)
            return y if w.bias is None else a.add(ctx, y, T[id(w.bias)])

        def rope(t):
            return a.rope_ext(ctx, t, pos, None, dim, ROPE_NEOX, self.n_ctx, self.base, 1.0, 0.0, 1.0, 32.0, 1.0)

        scale = 1.0 / math.sqrt(dim)
        for i, layer in enumerate(self.layers):
            h = a.mul(ctx, a.rms_norm(ctx, hidden, layer.eps), T[id(layer.input_norm)])
            q = rope(a.reshape_3d(ctx, linear(layer.q, h), dim, heads, rows))              # [dim, heads, R]
            k = rope(a.reshape_3d(ctx, linear(layer.k, h), dim, kv_heads, rows))           # [dim, kv, R]
            v = linear(layer.v, h)                                                          # [kv_size, R]
            views = []
            for r, (cache, p) in enumerate(zip(caches, positions)):
                ct, capacity = cache_tensor[id(cache)]
                plane = capacity * dim * f                     # one KV head of one layer's keys (or values)
                keys, values = (2 * i) * kv_heads * plane, (2 * i + 1) * kv_heads * plane
                for src, at in ((a.view_3d(ctx, k, dim, 1, kv_heads, kv_size * f, dim * f, r * kv_size * f), keys),
                                (a.view_3d(ctx, v, dim, 1, kv_heads, kv_size * f, dim * f, r * kv_size * f), values)):
                    dst = a.view_3d(ctx, ct, dim, 1, kv_heads, dim * f, plane, at + p * dim * f)
                    a.build_forward_expand(graph, a.cpy(ctx, src, dst))   # before any row's attention reads it
                views.append((ct, plane, keys, values, p))
            attn = a.new_tensor_2d(ctx, F32, q_size, rows)
            for r, (ct, plane, keys, values, p) in enumerate(views):
                qr = a.view_3d(ctx, q, dim, 1, heads, q_size * f, dim * f, r * q_size * f)   # [dim, 1, heads]
                kr = a.view_3d(ctx, ct, dim, p + 1, kv_heads, dim * f, plane, keys)
                vr = a.view_3d(ctx, ct, dim, p + 1, kv_heads, dim * f, plane, values)
                out = a.flash_attn_ext(ctx, qr, kr, vr, None, scale, 0.0, 0.0)              # [dim, heads, 1]
                a.build_forward_expand(graph, a.cpy(ctx, out, a.view_2d(ctx, attn, q_size, 1, q_size * f,
                                                                         r * q_size * f)))
            hidden = a.add(ctx, hidden, linear(layer.o, attn))
            h = a.mul(ctx, a.rms_norm(ctx, hidden, layer.eps), T[id(layer.post_norm)])
            hidden = a.add(ctx, hidden, linear(layer.down, a.swiglu_split(ctx, linear(layer.gate, h),
                                                                          linear(layer.up, h))))
        if not kept:   # a chunk of a call whose kept rows are elsewhere: its keys and values only
            a.build_forward_expand(graph, hidden)
        h = a.mul(ctx, a.rms_norm(ctx, hidden, self.eps), T[id(self.norm)])
        index = None
        if list(kept) != list(range(rows)):
            index = a.new_tensor_1d(ctx, I32, len(kept))
            h = a.get_rows(ctx, h, index)
        out = a.mul_mat(ctx, T[id(self.head.blocks)], h) if kept else None                # [vocab, kept]
        if out is not None:
            a.build_forward_expand(graph, out)
        inputs = [(h_in, x.float().contiguous()), (pos, torch.tensor(positions, dtype=torch.int32))]
        if index is not None:
            inputs.append((index, torch.tensor(kept, dtype=torch.int32)))
        for tensor, value in inputs:   # held in `inputs` while copied
            ctypes.memmove(a.get_data(tensor), value.data_ptr(), value.numel() * value.element_size())
        ggml.follow_threads()
        if g.compute(g.backend, graph) != 0:
            raise RuntimeError("ggml's graph compute failed")
        logits = torch.empty(len(kept), self.head.out_features)
        if out is not None:
            ctypes.memmove(logits.data_ptr(), a.get_data(out), logits.numel() * 4)
        return logits if self.restricted is None else self.restricted.scatter(logits)
