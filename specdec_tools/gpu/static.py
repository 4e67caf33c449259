"""The static step's costs (specdec.runtime.paged_step: one KV arena, a CUDA graph a
row bucket), beside the HBM floor, for the GPU check:

  - the device's copy bandwidth (a 1 GiB device-to-device copy, synchronized) and each
    model's floor: its weights' bytes read once at that rate;
  - ms of one step by rows after a 128-token prefix, each the least of a few replays
    (on the CPU, the eager step: it runs, its times say nothing of a GPU);
  - 4 greedy steps three ways: each token read back before the next step is queued (the
    CPU's loops), each read a step behind (a GPU's target-only decoding), and all chained
    on the device and read once (a GPU's drafter); and 4 sampled draft steps (T=0.7, the
    coordinator's default truncation) read each and chained;
  - 1 and 8 rows of one session after a 1,024-token context (its pages gathered once for its
    rows, read 8 times: flatness there);
  - the step's greedy tokens against the lean forward's over 16 decode steps (bf16:
    where they differ, a tie is all that may part them).
"""
from __future__ import annotations

import gc
import time

import torch

from coordinator.settings import DEFAULT_DRAFT_TOP_K, DEFAULT_DRAFT_TOP_P
from drafter.draft_session import greedy_draft, greedy_on_device
from specdec.runtime.kv_arena import KVArena, device_budget_bytes
from specdec.runtime.models import load_model
from specdec.runtime.paged_step import BUCKETS, PagedRunner
from specdec.runtime.sequence import SequenceCache
from specdec.runtime.device import HostCopy, policy
from specdec.service.warm_up import CURVE_PREFIX
from specdec.spec.draft_probs import Drawn, draw, read_drawn
from specdec.spec.sampling import SamplingConfig
from specdec.spec.transform import scores_to_probs, transform_logits, uniform
from specdec.spec.wire import Truncation
from specdec_tools.gpu.steps import bf16_steps_apart

ROWS = (1, 2, 4, 8, 16)
CHAIN = 4           # greedy steps timed each way a session reads its tokens
LONG_PREFIX = 1024  # a long prompt's context: one gather for a session's k rows, which attend k times
MAX_CONTEXT = 2048  # the tables' reach (the 128-token timings still read a 256-token context bucket)


def copy_bandwidth_gbps(device: torch.device, gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes moved (read + written) per second by a device copy, the best of a few."""
    n = int(gib * 2**30) // 2
    src = torch.empty(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    clock, best = policy(device).clock(), float("inf")
    for _ in range(repeats):
        started = clock()
        dst.copy_(src)
        best = min(best, clock() - started)
    del src, dst
    return round(2 * n * 2 / best / 1e9, 1)


def read_bytes(model: torch.nn.Module) -> int:
    """Bytes a step reads: every weight once (a fused layer's parts are views of its storage:
    counted once), but not an input embedding the head does not share (a step looks up a row)."""
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings()
    shared = head is not None and getattr(head, "weight", None) is embed
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in [*model.parameters(), *model.buffers()] if t is not None}
    if not shared:
        storages.pop(embed.untyped_storage().data_ptr(), None)
    return sum(storages.values())


def measure(label: str, path: str, *, device: str, seed: int, bandwidth_gbps: float, repeats: int = 5,
            quantize: str = "none", head_vocab: int = 0, compile: str | None = None,
            rows: tuple[int, ...] = ROWS) -> dict:
    """One model's static step: `quantize` and `head_vocab` as the services take them, `compile`
    a torch.compile backend for the step (PagedRunner), timed at `rows` (captured at those alone)."""
    torch_device = torch.device(device)
    loaded = load_model(path, dtype="bf16", device=device, quantize=quantize, head_vocab=head_vocab,
                        random_weights=seed)
    try:
        forward = loaded.lean
        assert forward is not None, "the lean forward does not cover this model"
        read = read_bytes(loaded.model)
        out = {"label": label, "read_bytes": read, "weights_gb": round(read / 1e9, 2)}
        out["floor_ms"] = round(out["weights_gb"] / bandwidth_gbps * 1e3, 3) if bandwidth_gbps else None
        # vLLM's sizing, held down to a quarter here: the services section runs after this one.
        # On the CPU, whose times say nothing of a GPU, an arena of what the tables reach.
        budget = min(device_budget_bytes(torch_device, fraction=0.25, cpu_bytes=256 << 20), 4 << 30)
        arena = KVArena.sized(len(forward.layers), forward.kv_heads, forward.head_dim, forward.dtype,
                              torch_device, budget)
        runner = PagedRunner(forward, arena, MAX_CONTEXT, buckets=rows if compile else sorted({*BUCKETS, *rows}),
                             compile=compile)
        started = time.perf_counter()
        try:
            runner.capture()
        except Exception as error:   # timed eager then, the capture's failure beside the times
            out["capture_error"] = f"{type(error).__name__}: {str(error)[:300]}"
            runner.graphs = False
            runner._graphs.clear()
        out["capture_s"] = round(time.perf_counter() - started, 1)
        out["graphs"] = runner.graphs
        ids = [(7 * i + 3) % loaded.vocab_size for i in range(LONG_PREFIX + max(rows))]
        clock = policy(torch_device).clock()
        sequence = prefilled(runner, arena, ids, CURVE_PREFIX)
        out["rows_ms"] = rows_ms(runner, sequence, ids, CURVE_PREFIX, rows, clock, repeats)
        one = out["rows_ms"][1]
        for count in (8, 16):
            if count in out["rows_ms"]:
                out[f"ratio_{count}"] = round(out["rows_ms"][count] / one, 2)
        if out["floor_ms"]:
            out["one_row_over_floor"] = round(one / out["floor_ms"], 2)
        sequence.crop(CURVE_PREFIX)
        out["chain_ms"] = chain_ms(loaded.vocab_size, runner, sequence, ids[CURVE_PREFIX], clock, repeats)
        long = prefilled(runner, arena, ids, LONG_PREFIX)
        out["long_rows_ms"] = rows_ms(runner, long, ids, LONG_PREFIX, [n for n in (1, 8) if n in rows], clock, repeats)
        arena.release(long)
        if len(out["long_rows_ms"]) == 2:
            out["long_ratio_8"] = round(out["long_rows_ms"][8] / out["long_rows_ms"][1], 2)
        sequence.crop(CURVE_PREFIX - 1)   # the prefix's last token is the first step's, as in SequenceCache
        out["greedy"] = greedy_against_lean(loaded, runner, sequence, ids[:CURVE_PREFIX])
        arena.release(sequence)
        return out
    finally:
        del loaded
        gc.collect()
        if torch_device.type == "cuda":
            torch.cuda.empty_cache()


def prefilled(runner: PagedRunner, arena: KVArena, ids: list[int], prefix: int):
    """A new sequence in the arena holding ids[:prefix], run in chunks of 64 rows."""
    sequence = arena.new_sequence()
    for start in range(0, prefix, 64):
        runner.forward([(ids[start:min(start + 64, prefix)], sequence, 0)])
    return sequence


def rows_ms(runner: PagedRunner, sequence, ids: list[int], prefix: int, rows, clock, repeats: int) -> dict:
    """ms of one step by rows after `prefix` cached positions, the least of `repeats` each: one
    session's k rows, which gather its pages once and attend over them k times."""
    return {count: least_ms(lambda: runner.forward([(ids[prefix:prefix + count], sequence, count)]),
                            lambda: sequence.crop(prefix), clock, repeats) for count in rows}


def least_ms(run, reset, clock, repeats: int) -> float:
    """The least ms of `repeats` runs, each after `reset` (untimed)."""
    best = float("inf")
    for _ in range(repeats):
        reset()
        started = clock()
        run()
        best = min(best, clock() - started)
    return round(best * 1e3, 3)


def chain_ms(vocab: int, runner: PagedRunner, sequence, first: int, clock, repeats: int,
             steps: int = CHAIN) -> dict:
    """`steps` greedy steps on the step, each way a session reads its tokens: each read back
    before the next step is queued (the CPU's loops), each read a step behind with the next
    step fed from the device (a GPU's target-only decoding: verifier.target_session), and all
    fed from the device and read once (a GPU's greedy draft round: drafter.draft_session); and
    `steps` sampled draft steps as the drafter takes them (`draw`, T=0.7, the coordinator's
    default truncation), each read back, and chained and read once. The least of a few runs each."""
    start = sequence.length

    def step(fed) -> torch.Tensor:
        return runner.forward([(fed, sequence, 1)])[0][0, :vocab]

    def read_each() -> None:
        token = first
        for _ in range(steps):
            token, _ = greedy_draft(step([token]))

    def read_behind() -> None:
        fed, last = [first], None
        for _ in range(steps):
            token = step(fed).argmax(dim=-1, keepdim=True)
            copy = HostCopy(token)
            if last is not None:
                last.tolist()
            fed, last = token, copy
        last.tolist()

    def chained() -> None:
        fed, tokens, confidences = [first], [], []
        for _ in range(steps):
            token, confidence = greedy_on_device(step(fed))
            tokens.append(token)
            confidences.append(confidence)
            fed = token.view(1)
        torch.stack([torch.stack(tokens).double(), torch.stack(confidences).double()]).tolist()

    generator = torch.Generator(device=runner.device).manual_seed(0)
    sampling, truncation = SamplingConfig(temperature=0.7), Truncation(DEFAULT_DRAFT_TOP_K, DEFAULT_DRAFT_TOP_P)

    def sampled(fed) -> Drawn:
        scores = transform_logits(step(fed)[None], (), (), sampling, vocab)
        return draw(scores_to_probs(scores)[0], truncation, uniform(generator))

    def sampled_read_each() -> None:
        token = first
        for _ in range(steps):
            token = read_drawn([sampled([token])])[0][0]

    def sampled_chained() -> None:
        fed, drawn = [first], []
        for _ in range(steps):
            drawn.append(sampled(fed))
            fed = drawn[-1].token.view(1)
        read_drawn(drawn)

    out = {name: least_ms(run, lambda: sequence.crop(start), clock, repeats)
           for name, run in (("read_each", read_each), ("read_behind", read_behind), ("chained", chained),
                             ("sampled_read_each", sampled_read_each), ("sampled_chained", sampled_chained))}
    sequence.crop(start)
    return out


def greedy_against_lean(loaded, runner: PagedRunner, sequence, prefix: list[int], tokens: int = 16) -> dict:
    """16 greedy steps of each path from the same prefix: the tokens they agree on before the first
    difference, and whether that difference is a tie on the lean forward's logits (two bf16 steps)."""
    lean = SequenceCache(loaded, prefix)
    lean.prefill()
    last = prefix[-1]
    agreed = 0
    for _ in range(tokens):
        mine = int(runner.forward([([last], sequence, 1)])[0][0, :loaded.vocab_size].argmax())
        logits = lean.forward([], keep_last=1)[0][:loaded.vocab_size]
        theirs = int(logits.argmax())
        if mine != theirs:
            apart = bf16_steps_apart(float(logits[theirs]), float(logits[mine]))
            return {"agreed": agreed, "of": tokens, "first_difference_bf16_steps": round(apart, 2)}
        lean.append([theirs])
        last, agreed = theirs, agreed + 1
    return {"agreed": agreed, "of": tokens}
