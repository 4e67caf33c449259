"""A lean forward for the Llama/Qwen2 family over a static KV cache.

transformers' forward is general: per call it builds masks and position
tensors, walks a cache object, and dispatches through several layers of
modules and attention interfaces. For one decode row of a 1.5B model in int4
that bookkeeping costs as much as a third of the step (docs/runs/quantization.md).
This forward does only the model's arithmetic, on the model's own modules
(whatever their weights: bf16 Linear, Int4Linear, Int8 GEMMs), so quantization
stays orthogonal to it:

    embed -> per layer: norm, q/k/v, rotary, write K/V at their positions,
    attention over the cached prefix, o, residual, norm, MLP, residual
    -> final norm and LM head on the rows the caller keeps.

Its KV cache is specdec.runtime.kv_cache.StaticKVCache: rolling back rejected
drafts is moving its length back, so nothing is copied or recomputed.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from specdec.runtime import dense_rows, ggml_forward, kernel_choices
from specdec.runtime.decoder_layer import (Layer, LinearCall, direct, on_threads, op_threads, rms_norm, rotate,
                                           signed_sin)
from specdec.runtime.device import policy
from specdec.runtime.kv_cache import StaticKVCache
from specdec.runtime.kv_pool import KVPool

FAMILIES = ("llama", "qwen2")


def supports(model: nn.Module) -> str | None:
    """None if `model` can run the lean forward, else why not."""
    config = model.config
    if config.model_type not in FAMILIES:
        return f"model type {config.model_type!r} is not one of {', '.join(FAMILIES)}"
    if getattr(config, "use_sliding_window", False):
        return "sliding-window attention is not implemented in the lean forward"
    for layer in model.model.layers:
        attn = layer.self_attn
        if not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
            return "a layer without q/k/v/o projections"
        if hasattr(attn, "q_norm") or hasattr(attn, "k_norm"):
            return "per-head q/k norms are not implemented in the lean forward"
        if not all(hasattr(n, "variance_epsilon") for n in (layer.input_layernorm, layer.post_attention_layernorm)):
            return "a layer whose norms are not RMSNorm"
    return None


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """q [heads, T, dim], k and v [kv_heads, L, dim], mask [T, L] or None -> [heads, T, dim].

    Two batched matmuls with the query heads of each KV head stacked as rows
    (grouped-query attention without repeating K and V), softmax in fp32 as
    transformers' eager attention does. For the few rows of a decode or verify
    step this is 4-10x faster on the CPU than scaled_dot_product_attention,
    whose flash kernel is built for long query blocks; for a prefill's many rows
    that kernel is the faster (26 against 75 ms a layer for 1,024 rows here), as
    it never builds the rows x length scores."""
    heads, rows, dim = q.shape
    kv_heads, length, _ = k.shape
    if mask is None:
        return bmm_attention(q, k, v, mask)
    if not policy(q.device).timed_kernels:   # host timing would not tell (device.py)
        return _sdpa_attention(q, k, v, mask)
    return dense_rows.run(("attention", heads, kv_heads, dim), rows, lambda: bmm_attention(q, k, v, mask),
                          lambda: _sdpa_attention(q, k, v, mask), names=("bmm", "sdpa"))


def _sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    rows, length = mask.shape
    whole = rows == length  # the whole sequence: the mask is the causal one
    out = F.scaled_dot_product_attention(q.to(k.dtype)[None], k[None], v[None], attn_mask=None if whole else mask,
                                         is_causal=whole, enable_gqa=True)
    return out[0].to(q.dtype)


def bmm_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    heads, rows, dim = q.shape
    kv_heads, length, _ = k.shape
    scores = torch.bmm(q.reshape(kv_heads, heads // kv_heads * rows, dim).to(k.dtype), k.transpose(1, 2))
    scores = scores.mul_(dim ** -0.5)                                                  # [kv_heads, g*T, L]
    if mask is not None:
        scores.view(kv_heads, heads // kv_heads, rows, length).masked_fill_(~mask, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
    return torch.bmm(probs, v).view(heads, rows, dim).to(q.dtype)


def _attention_by_row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """q [heads, T, dim] at positions start.., k and v [kv_heads, start + T, dim] -> [heads, T, dim],
    each row as a one-row step at its position computes it: over its own prefix, unmasked.

    A masked call over T rows reduces every row's softmax and value sum over the
    call's whole length, and the CPU's kernels block those reductions by length:
    on the 1.5B int4 target a 3-row verification then gave other bits than three
    decode steps from the first layer on, and greedy speculative output left
    target-only's on 2 of 4 short prompts. Row by row, a verification's logits
    are a decode step's, bit for bit, for T small calls instead of one."""
    rows = q.shape[1]
    return torch.cat([bmm_attention(q[:, r:r + 1], k[:, :start + r + 1], v[:, :start + r + 1], None)
                      for r in range(rows)], dim=1)


class LeanForward:
    """The arithmetic of a Llama/Qwen2 causal LM's forward, on the model's own modules."""

    def __init__(self, model: nn.Module):
        reason = supports(model)
        assert reason is None, reason
        config = self.config = model.config
        self.layers = [Layer(layer) for layer in model.model.layers]
        self.embed = model.model.embed_tokens
        self.norm = model.model.norm
        self.rotary = model.model.rotary_emb
        self.lm_head = model.get_output_embeddings()
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.dtype = self.embed.weight.dtype
        self._graph_choice: ggml_forward.GraphForward | bool | None = None   # None: not chosen yet
        # Rows of several sessions' decode and verify calls in one forward still get each
        # session's own bits (the services' --batch-invariant); else they take the kernels
        # timed fastest for the batch (`_gathered`).
        self.batch_invariant = False

    def linears(self) -> list[nn.Module]:
        """Every layer's projections as the forward calls them (not the LM head, which
        only ever sees the rows kept)."""
        return [m for layer in self.layers for m in layer.linears()]

    def token_bytes(self) -> int:
        """KV cache bytes per token (every layer's keys and values)."""
        return len(self.layers) * 2 * self.kv_heads * self.head_dim * self._cache_dtype().itemsize

    def _cache_dtype(self) -> torch.dtype:
        return policy(self.embed.weight.device).cache_dtype(self.dtype)

    def new_cache(self, pool: KVPool | None = None) -> StaticKVCache:
        return StaticKVCache(len(self.layers), self.kv_heads, self.head_dim, self._cache_dtype(),
                             self.embed.weight.device, pool)

    def feed_ids(self, feed: Sequence[int], ids: torch.Tensor | None = None) -> torch.Tensor:
        """What `batch` takes for a forward's feed: its ids on the model's device (`ids` where
        the device decided them)."""
        return ids if ids is not None else torch.tensor(list(feed), dtype=torch.long, device=self.embed.weight.device)

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, cache: StaticKVCache, keep_last: int) -> torch.Tensor:
        """ids [T] at positions cache.length.. -> logits [keep_last, model_vocab] float32."""
        return self.batch([(ids, cache, keep_last)])[0]

    @torch.inference_mode()
    def batch(self, items: list[tuple[torch.Tensor, StaticKVCache, int]]) -> list[torch.Tensor]:
        """One forward over the new rows of several sequences, each at its own
        positions in its own cache: [(ids [T_i], cache_i, keep_last_i)] ->
        [logits [keep_last_i, model_vocab] float32].

        The Linear layers (q/k/v, o, the MLP, the LM head) run once over all the
        rows, which is where batching pays: their weights are read once for the
        batch, not once per sequence. Attention runs per sequence over its own
        cached prefix. keep_last_i may be 0 (a prefill chunk: no logits)."""
        for ids, cache, keep_last in items:
            assert ids.ndim == 1 and ids.shape[0] > 0 and 0 <= keep_last <= ids.shape[0], (ids.shape, keep_last)
        lengths = [cache.length for _, cache, _ in items]
        try:
            graph = self._graph()
            # Several sessions' decode and verify calls, or several prefill chunks (each would
            # read every dense weight once for itself): the kernels fastest for the rows. One
            # logit-keeping call beside one chunk keeps its own bits, as it would alone.
            kept = sum(keep > 0 for _, _, keep in items)
            if not self.batch_invariant and (kept > 1 or len(items) - kept > 1):
                return self._gathered(items, graph, lengths)
            return self._exact(items, graph)
        except BaseException:
            # A forward that fails (out of memory, a kernel's error) leaves every cache
            # at the length it had: the KV written past it is never read, and a rerun
            # writes it again. The caller's session is then as before the call.
            for (_, cache, _), length in zip(items, lengths):
                cache.length = length
            raise

    def _exact(self, items: list[tuple[torch.Tensor, StaticKVCache, int]],
               graph: "ggml_forward.GraphForward | None") -> list[torch.Tensor]:
        """Each call's rows computed as that call alone would be: decode and verify calls on
        the ggml graph where it was chosen, the others (prefill chunks) beside them on torch's."""
        on_graph = [graph is not None and ggml_forward.on_graph(ids.shape[0], keep) for ids, _, keep in items]
        if not any(on_graph):
            return self._batch(items)
        out: list[torch.Tensor | None] = [None] * len(items)
        for graphed, run in ((False, self._batch), (True, lambda part: ggml_forward.run_items(graph, part))):
            where = [j for j, g in enumerate(on_graph) if g == graphed]
            if where:
                for j, logits in zip(where, run([items[j] for j in where])):
                    out[j] = logits
        return out

    def _gathered(self, items: list[tuple[torch.Tensor, StaticKVCache, int]],
                  graph: "ggml_forward.GraphForward | None", lengths: list[int]) -> list[torch.Tensor]:
        """Several sessions' decode and verify calls (and any prefill chunks beside them) in
        one forward, on the path timed fastest for the forward's row bucket: torch's ops with
        each layer on the kernel fastest for the rows (`kernel_choices.gathered`: kernels that share
        a weight's de-quantization among rows, torch's int4 four rows a pass, where the
        graph's GEMVs, which a session's exact bits need, pay it again for every row), or the
        exact path itself, which a few rows may still favour. Timing a path runs the forward again
        from the same cache lengths, over the same keys and values."""
        # Decode and verify rows alone, none at position 0 (the attention sink, whose channels
        # 8 bits a row cannot hold): layers may take their fewer-bit kernels.
        decode_rows = all(keep > 0 for _, _, keep in items) and min(lengths) > 0

        def torch_path() -> list[torch.Tensor]:
            with kernel_choices.gathered(decode_rows):
                if any(keep == 0 for _, _, keep in items):   # a prefill chunk's ops span its many rows
                    return self._batch(items, attention_threads=1, one_call=True)
                # Decode and verify rows alone: between the linear layers each op is a few KB to a few
                # hundred, where waking the second OpenMP worker costs more than the work (8 sessions'
                # rows on the 1.5B, 2-core EPYC: 153 against 148 ms a forward).
                return self._batch(items, one_call=True, light_threads=1)
        # With prefill chunks, torch's path without timing it: the exact path runs each chunk's
        # dense matmuls apart, reading every weight once a session (7 sessions' 7-token prompts:
        # 750 against 240 ms here), and timing both at the first such batch cost its requests 3-5 s.
        if graph is None or any(keep == 0 for _, _, keep in items):
            return torch_path()

        def again(run):
            def call() -> list[torch.Tensor]:
                for (_, cache, _), length in zip(items, lengths):
                    cache.length = length
                return run()
            return call
        key = ("forward", "gathered", f"{len(self.layers)}x{self.embed.weight.shape[1]}")
        rows = sum(ids.shape[0] for ids, _, _ in items)
        if kernel_choices.chosen(key, rows) is None:
            # Its layers choose their kernels first, so timing the path times them, not their choice.
            again(torch_path)()
        return kernel_choices.pick(key, rows, {"torch": again(torch_path),
                                               "exact": again(lambda: self._exact(items, graph))})

    def _graph(self) -> "ggml_forward.GraphForward | None":
        """The ggml graph that runs decode and verify calls, where it was chosen (on the first call)."""
        if self._graph_choice is None:
            self._graph_choice = ggml_forward.choose(self) or False
        return self._graph_choice or None

    def _batch(self, items: list[tuple[torch.Tensor, StaticKVCache, int]],
               attention_threads: int = 0, one_call: bool = False, light_threads: int = 0) -> list[torch.Tensor]:
        """attention_threads: the torch threads each layer's per-sequence attention runs on
        (0: as many as the rest of the forward). one_call: the layers take every call's rows
        as one call's (gathered batches: one dense matmul reads a weight once for all the
        sessions' prefill rows, where each call's own read it once per call). light_threads:
        where fewer than in force, every op but the linear layers (norms, rotary, residuals,
        the activation, attention) runs on this many threads, the linear layers on all."""
        threads = torch.get_num_threads()
        if not light_threads or light_threads >= threads:
            return self._rows(items, attention_threads, one_call, direct)
        with op_threads(light_threads):
            return self._rows(items, attention_threads, one_call, on_threads(threads))

    def _rows(self, items: list[tuple[torch.Tensor, StaticKVCache, int]], attention_threads: int,
              one_call: bool, linear: LinearCall) -> list[torch.Tensor]:
        """`_batch`, its linear layers run by `linear`."""
        spans = []                                                                       # (rows, start, end)
        for ids, cache, _ in items:
            rows, start = ids.shape[0], cache.length
            cache.reserve(start + rows)
            spans.append((rows, start, start + rows))
        ids = items[0][0] if len(items) == 1 else torch.cat([ids for ids, _, _ in items])
        device = ids.device
        x = self.embed(ids)                                                              # [R, hidden]
        positions = [torch.arange(start, end, device=device) for _, start, end in spans]
        cos, sin = self.rotary(x[None], (positions[0] if len(items) == 1 else torch.cat(positions))[None])
        cos, sin = cos[0, :, None], signed_sin(sin[0])[:, None]                           # [R, 1, dim] each
        # A call whose logits pick tokens (decode, verify: those dense_rows keeps on the kernel) computes
        # each row's attention as a one-row step would (`_attention_by_row`), on the CPU, where
        # the result is the kernels' to the bit; others take one masked call. Row i of a
        # sequence sees its positions 0..start+i; a single row sees everything, so needs no mask.
        prefill = [keep_last == 0 for _, _, keep_last in items]                          # no logits kept
        by_row = [policy(device).exact_rows and rows > 1 and not dense_rows.timed(rows, chunk)
                  for (rows, _, _), chunk in zip(spans, prefill)]
        masks = [None if rows == 1 or row_wise else torch.arange(end, device=device)[None, :] <= pos[:, None]
                 for (rows, _, end), pos, row_wise in zip(spans, positions, by_row)]                # [T, end]
        offsets = [0]
        for rows, _, _ in spans:
            offsets.append(offsets[-1] + rows)
        calls = ([sum(rows for rows, _, _ in spans)], [any(prefill)]) if one_call else \
            ([rows for rows, _, _ in spans], prefill)
        with dense_rows.by_call(*calls):  # each call's rows on its own path, or all as one
            x = self._layers(x, items, spans, offsets, cos, sin, masks, by_row, attention_threads, linear)
        for (_, _, end), (_, cache, _) in zip(spans, items):
            cache.length = end
        # The LM head only over the rows kept: [sum keep_last, hidden].
        kept = [(offsets[j + 1] - keep_last, offsets[j + 1]) for j, (_, _, keep_last) in enumerate(items)]
        if len(items) == 1:
            rows_kept = x[kept[0][0]:kept[0][1]]
        else:
            rows_kept = torch.cat([x[lo:hi] for lo, hi in kept])
        if rows_kept.shape[0] == 0:
            return [rows_kept.new_empty((0, 0), dtype=torch.float32) for _ in items]
        with dense_rows.by_call([keep_last for _, _, keep_last in items]):
            logits = linear(self.lm_head, rms_norm(self.norm, rows_kept)).float()
        return list(logits.split([keep_last for _, _, keep_last in items]))

    def _layers(self, x: torch.Tensor, items: list[tuple[torch.Tensor, StaticKVCache, int]],
                spans: list[tuple[int, int, int]], offsets: list[int], cos: torch.Tensor, sin: torch.Tensor,
                masks: list[torch.Tensor | None], by_row: list[bool], attention_threads: int = 0,
                linear: LinearCall = direct) -> torch.Tensor:
        """The decoder layers over x [R, hidden] (sequence j's rows at offsets[j]:offsets[j + 1],
        its positions spans[j]), each sequence's keys and values into its cache; sequence j's
        attention under masks[j], or row by row where by_row[j]; a decode or verify call's
        (logits kept) on `attention_threads` threads where that is set."""
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        threads = [attention_threads if keep_last > 0 else 0 for _, _, keep_last in items]
        for i, layer in enumerate(self.layers):
            qk, v = layer.project_qk_v(rms_norm(layer.input_norm, x), heads + kv_heads, dim, linear)  # [R, h+kv, dim]
            qk = rotate(qk, cos, sin)
            # Every row's new keys and values [2, kv_heads, R, dim] and queries [heads, R, dim] laid
            # out once, so a sequence's are a slice each and its keys and values one copy: a forward
            # of 8 sessions' decode rows runs this loop 224 times (the same bits, 0.99 of its time).
            new_kv = torch.stack([qk[:, heads:], v.view(-1, kv_heads, dim)]).transpose(1, 2)
            queries = qk[:, :heads].transpose(0, 1)
            outs = []
            for j, ((rows, start, end), (_, cache, _)) in enumerate(zip(spans, items)):
                lo, hi = offsets[j], offsets[j + 1]
                kv = cache.buffer[i]                                           # [2, kv_heads, capacity, dim]
                kv[:, :, start:end] = new_kv[:, :, lo:hi]
                q, keys, values = queries[:, lo:hi], kv[0, :, :end], kv[1, :, :end]
                with op_threads(threads[j]):
                    outs.append(_attention_by_row(q, keys, values, start) if by_row[j]
                                else _attention(q, keys, values, masks[j]))                # [heads, T, dim]
            out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)                     # [heads, R, dim]
            x = x + linear(layer.o_proj, out.transpose(0, 1).reshape(-1, heads * dim))
            x = x + layer.feed_forward(rms_norm(layer.post_norm, x), linear)
        return x
