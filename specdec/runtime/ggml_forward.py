"""Which forward runs the lean forward's decode and verify calls: torch's ops, or
one ggml graph (specdec.runtime.ggml_graph) over the blocks as they are or
repacked. Each graph path is checked against the torch forward on the model at
hand, proved to give a verification its decode steps' bits, and timed; the
fastest serves (one choice per process: the paths round differently).
"""
from __future__ import annotations

import logging
import math

import torch

from specdec.runtime import dense_rows, kernel_choices, kernels
from specdec.runtime.ggml_graph import GraphForward, Unsupported

log = logging.getLogger(__name__)

# kernels' key of the choice (a pin under it holds for every model; a choice made by timing is
# the model shape's): "torch" (the lean forward's ops), "ggml-graph" (the blocks as they are) or
# "ggml-graph-repacked" (the Q4_K and Q4_0 weights laid out for ggml's repacked kernels).
KEY = ("forward", "decode")
NAMES = ("torch", "ggml-graph", "ggml-graph-repacked")
# The graph's logits within this relative error of the torch forward's, on 8 arbitrary tokens.
# The two round differently: on the 1.5B int4 target the torch forward on torch's own int4
# kernel (Q4_K's scales rounded to bf16) differed by 0.18 (the graph's top-1 against fp32 was
# 1.000 on real prompts, torch's 0.993); the graph with the rotary's halves laid out the other
# way by 0.37, without q/k/v's biases by 1.3.
CHECK_TOLERANCE = 0.3


def on_graph(rows: int, keep_last: int) -> bool:
    """Whether a call of `rows` keeping `keep_last` logits runs on the graph, where it is chosen:
    decode and verify calls (the kernel's, dense_rows); prefill chunks keep torch's paths."""
    return keep_last > 0 and not dense_rows.timed(rows, False)


def run_items(graph: GraphForward, items: list) -> list[torch.Tensor]:
    """[(ids [T], cache, keep_last)] -> [logits [keep_last, vocab] float32], each call's rows
    graph.chunk_rows at a time (rows of several calls may share a graph: each row is computed
    alone); every cache's length moves past its rows."""
    caches, positions, kept = [], [], []
    for ids, cache, keep_last in items:
        rows, start = ids.shape[0], cache.length
        cache.reserve(start + rows)
        caches += [cache] * rows
        positions += range(start, start + rows)
        kept += [False] * (rows - keep_last) + [True] * keep_last
    x = graph.lean.embed(items[0][0] if len(items) == 1 else torch.cat([ids for ids, _, _ in items]))
    logits = []
    for lo in range(0, len(kept), graph.chunk_rows):
        hi = min(lo + graph.chunk_rows, len(kept))
        logits.append(graph.rows(x[lo:hi], caches[lo:hi], positions[lo:hi],
                                 [r - lo for r in range(lo, hi) if kept[r]]))
    for ids, cache, _ in items:
        cache.length += ids.shape[0]
    return list(torch.cat(logits).split([keep_last for _, _, keep_last in items]))


@torch.no_grad()
def check(lean, graph: GraphForward) -> str | None:
    """None if the graph computes this model as it must, else what is wrong: 8 one-row steps
    and two 4-row calls over the same tokens give the same logits bit for bit (a verification
    is its decode steps), within CHECK_TOLERANCE of the torch forward's."""
    vocab = lean.embed.weight.shape[0]
    ids = (torch.arange(8) * 37 + 11) % vocab
    steps, calls, own = lean.new_cache(), lean.new_cache(), lean.new_cache()
    one = torch.cat([run_items(graph, [(ids[i:i + 1], steps, 1)])[0] for i in range(8)])
    four = torch.cat([run_items(graph, [(ids[i:i + 4], calls, 4)])[0] for i in (0, 4)])
    if not torch.equal(one, four):
        return "a row's logits changed with the rows beside it in a call"
    want = lean._batch([(ids, own, 8)])[0]
    finite = torch.isfinite(want)       # a head cut to some ids leaves the others at -inf
    if not torch.equal(finite, torch.isfinite(one)):
        return "its logits are not finite where the torch forward's are, or are where they are not"
    one, want = one[finite], want[finite]
    error = float((one - want).norm() / want.norm().clamp(min=1e-12))
    if not math.isfinite(error) or error > CHECK_TOLERANCE:
        return f"relative error {error:.3g} against the torch forward's logits"
    return None


def _candidates(lean) -> dict[str, GraphForward]:
    """The graphs that pass `check` here, by name: the blocks as they are, and (where any
    weight's type passes its probe) laid out for ggml's repacked kernels."""
    graphs = {}
    for name, repack in ((NAMES[1], False), (NAMES[2], True)):
        try:
            graph = GraphForward(lean)
        except Unsupported as why:
            log.info("decode and verify calls run through torch: the ggml graph does not cover %s", why)
            return {}
        try:
            graph.place(repack=repack)
        except RuntimeError as why:   # a refusal (ggml.place), not an abort: the torch forward serves
            log.warning("decode and verify calls will not run on %s: %s", name, why)
            continue
        if repack and not graph.repacked:
            continue
        reason = check(lean, graph)
        if reason is None:
            graphs[name] = graph
        else:
            log.warning("decode and verify calls will not run on %s: it failed its check (%s)", name, reason)
    return graphs


def choose(lean) -> GraphForward | None:
    """The graph for `lean`'s decode and verify calls where it runs here, passes `check` and
    times faster than the torch forward on a call of kernels' choice rows (`choose_at`);
    else None, said in the log. One choice for the process: they round differently."""
    if kernel_choices.chosen(KEY, 0) == NAMES[0]:
        return None     # pinned to torch
    try:
        GraphForward(lean)  # what the graph covers, before ggml is loaded and probed (a second of a start)
    except Unsupported as why:
        log.info("decode and verify calls run through torch: the ggml graph does not cover %s", why)
        return None
    if not kernels.usable("gguf-blocks", per_row=True):
        return None     # no ggml here (the kernel registry said why, once)
    graphs = _candidates(lean)
    pinned = kernel_choices.chosen(KEY, 0)     # a pin for every model (tests, scripts)
    if pinned in graphs:
        return graphs[pinned]
    if not graphs:
        return None
    # Chosen per model shape: a script may hold a target and a draft, whose best paths differ.
    key = (*KEY, f"{len(lean.layers)}x{lean.embed.weight.shape[1]}")
    rows = kernel_choices.choice_rows()
    ids = (torch.arange(rows) * 101 + 7) % lean.embed.weight.shape[0]
    names = [NAMES[0], *graphs]
    caches = {name: lean.new_cache() for name in names}
    for name, cache in caches.items():   # a short context, as a chat's first tokens
        lean._batch([((torch.arange(16) * 13 + 5) % lean.embed.weight.shape[0], cache, 0)])

    def step(name: str) -> torch.Tensor:
        cache = caches[name]
        cache.length = 16
        if name == NAMES[0]:
            return lean._batch([(ids, cache, rows)])[0]
        return run_items(graphs[name], [(ids, cache, rows)])[0]
    kernel_choices.pick(key, rows, {name: (lambda name=name: step(name)) for name in names}, per_layer=True)
    chosen = kernel_choices.chosen(key, 0)
    log.info("decode and verify calls: %s (timed on %d rows)", chosen, rows)
    return graphs.get(chosen)   # the others' buffers are freed with them
