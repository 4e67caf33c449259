"""A model service's start: warm-up, and the timings it serves on.

Before SERVING, a service warms its model and times what the coordinator and the
scheduler plan with: the cost curve (a forward's ms by rows, the prefill's per
token), the kernels of every prefill row bucket and of batches of several
sessions' rows. Where a start profile (specdec.service.start_profile) saved by an
earlier start still holds, its choices and curves are reused instead.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Callable

from specdec.runtime import dense_rows, kernel_choices, torch_thread
from specdec.runtime.cost_curve import CostCurve
from specdec.runtime.models import LoadedModel
from specdec.runtime.sequence import PREFILL_CHUNK, SequenceCache, drive
from specdec.service import start_profile

log = logging.getLogger(__name__)


def warm_up(loaded: LoadedModel) -> None:
    """One short forward so the first request does not pay for lazy init."""
    ids = loaded.tokenizer.encode("warm up", add_special_tokens=False) or [0]
    SequenceCache(loaded, ids).forward([], keep_last=1)


def time_prefill_buckets(loaded: LoadedModel, prefill_chunk: int = PREFILL_CHUNK) -> None:
    """Prefill one chunk of each row bucket a chunk can fall in, so kernel_choices.pick has
    timed its paths before any request meets it (otherwise the request that does
    pays: the first 228-token prompt on an AVX2 EPYC waited 10.3 s for its first
    token where the next waited 5.9)."""
    if not loaded.policy.timed_kernels:
        return
    filler = [(7 * i + 3) % loaded.vocab_size for i in range(prefill_chunk + 1)]
    for rows in sorted({min(kernel_choices.bucket(n), prefill_chunk)
                        for n in range(dense_rows.MIN_PREFILL_ROWS, prefill_chunk + 1)}):
        drive(SequenceCache(loaded, filler[:rows + 1]).prefill_steps(chunk=rows))  # one chunk of `rows`


GATHERED_ROWS = 32  # the largest batch of decode rows timed at warm-up (more: timed at its first forward)


def time_gathered_buckets(loaded: LoadedModel, max_sessions: int) -> dict[int, float]:
    """For each row bucket n up to GATHERED_ROWS (and max_sessions), forwards of n sessions'
    decode rows: the first chooses the kernels for batches of several sessions (lean's
    `_gathered`) and makes their int8 weights before any request waits for it; the least of
    three more is what such a batch costs, {n: ms}, for the scheduler's batch sizes. Nothing
    where batches keep each session's bits (--batch-invariant) or the timed paths are not the CPU's."""
    lean = loaded.lean
    if lean is None or lean.batch_invariant or not loaded.policy.timed_kernels:
        return {}
    started = time.perf_counter()
    prompt = [(5 * i + 1) % loaded.vocab_size for i in range(16)]
    costs = {}
    for sessions in sorted({kernel_choices.bucket(n) for n in range(2, min(GATHERED_ROWS, max_sessions) + 1)}):
        seqs = [SequenceCache(loaded, prompt) for _ in range(sessions)]
        for seq in seqs:
            seq.prefill()
        times = []
        for _ in range(4):
            for seq in seqs:    # the same row again: a decode step taken back
                seq.cache.length = len(prompt) - 1
            begun = time.perf_counter()
            lean.batch([(lean.feed_ids(seq.tokens[-1:]), seq.cache, 1) for seq in seqs])
            times.append((time.perf_counter() - begun) * 1e3)
        costs[sessions] = round(min(times[1:]), 3)
    log.info("kernels for batches of 2..%d sessions' rows timed in %.1f s; such a batch's ms by rows: %s",
             min(GATHERED_ROWS, max_sessions), time.perf_counter() - started,
             ", ".join(f"{n}: {ms:.1f}" for n, ms in costs.items()))
    return costs


CURVE_PREFIX = 128  # tokens cached before each timed forward: a short prompt's worth


def measure_cost_curve(loaded: LoadedModel, rows: int, repeats: int = 3, prefills: int = 2) -> CostCurve:
    """The least ms of `repeats` forwards over 1..rows new rows after a CURVE_PREFIX-token
    prefix: what verifying γ = rows - 1 drafts costs, or a draft step (1 row).
    Rows are not free in every precision (int4 takes 4 a kernel pass), so the
    coordinator plans γ on this curve rather than on a line. And what the prefix's
    prefill cost per token: the coordinator weighs a drafter's prefill of a long
    prompt against what drafting can save (the least of `prefills`; 0: the prefix prefilled once, untimed)."""
    if rows <= 0:
        return CostCurve([], 0.0)
    ids = [(7 * i + 3) % loaded.vocab_size for i in range(CURVE_PREFIX + rows)]
    per_token = []
    clock = loaded.policy.clock()
    for _ in range(max(prefills, 1)):
        seq = SequenceCache(loaded, ids[:CURVE_PREFIX])
        started = clock()
        seq.prefill()  # all but the last prefix token
        per_token.append((clock() - started) * 1e3 / (CURVE_PREFIX - 1))
    seq.forward([], keep_last=1)
    curve = []
    for n in range(1, rows + 1):
        times = []
        for _ in range(repeats):
            started = clock()
            seq.forward(ids[CURVE_PREFIX:CURVE_PREFIX + n], keep_last=n)
            times.append((clock() - started) * 1e3)
            seq.truncate(CURVE_PREFIX)  # the rollback a rejected draft gets
        curve.append(round(min(times), 3))  # the least disturbed: another process may share the cores
    return CostCurve(curve, round(min(per_token), 4) if prefills else 0.0)


@dataclass(frozen=True)
class Timed:
    """What a start serves on, and whether it may be kept as a start profile."""
    curve: CostCurve
    gathered: dict[int, float]
    timed: bool          # timed by this start (not a saved profile's)
    keep: bool           # timed on a quiet machine, and in agreement with itself; or a saved profile's
    replaces: bool = False   # timed because a saved profile disagreed on a quiet machine


def decode_step_ms(loaded: LoadedModel, within: CostCurve | None = None) -> float:
    """The least of up to CHECK_TRIES decode steps, stopping at one within `within`'s
    (a restart's first steps can meet the cores busy)."""
    decode_ms = math.inf
    for _ in range(start_profile.CHECK_TRIES):
        decode_ms = min(decode_ms, torch_thread.run(measure_cost_curve, loaded, 1, prefills=0).forward_ms[0])
        if within is not None and start_profile.holds(within, decode_ms):
            break
    return decode_ms


def warm_and_time(loaded: LoadedModel, service_name: str, key: dict | None, cost_curve_rows: int,
                  prefill_chunk: int, max_sessions: int) -> Timed:
    """Warm up, then the cost curve and the gathered batches' costs: a start profile's,
    saved under `key` by a start before, where a decode step timed now agrees with it, or
    where it does not only because other processes keep the cores busy (its kernel
    choices restored before warm-up, which would time them); else timed, with the prefill
    and gathered row buckets' kernel choices, and kept only where the machine was quiet
    and a decode step timed again agrees with the curve (start_profile's docstring)."""
    # The cores' load is what a CPU's timings depend on; a GPU's steps depend on the device.
    on_cpu = str(loaded.device).startswith("cpu")

    def others_share(load: start_profile.MachineLoad) -> float:
        return load.others_share() if on_cpu else 0.0
    load = start_profile.MachineLoad()
    profile = start_profile.load(key) if key is not None else None
    if profile is not None:
        kernel_choices.restore_choices(profile.choices)
    torch_thread.run(warm_up, loaded)
    if profile is not None:
        decode_ms = decode_step_ms(loaded, profile.curve)
        saved, busy = start_profile.path_for(key), others_share(load)
        if start_profile.holds(profile.curve, decode_ms):
            log.info("%s: kernel choices and cost curves from %s (a decode step now %.1f ms, then %.1f ms)",
                     service_name, saved, decode_ms, profile.curve.forward_ms[0])
            return Timed(profile.curve, profile.gathered, timed=False, keep=True)
        if busy >= start_profile.QUIET_SHARE:
            log.info("%s: a decode step now takes %.1f ms, %.1f ms when %s was saved, while other processes use "
                     "%.0f%% of the cores: the saved profile serves (the live curve follows real forwards)",
                     service_name, decode_ms, profile.curve.forward_ms[0], saved, 100 * busy)
            return Timed(profile.curve, profile.gathered, timed=False, keep=True)
        log.info("%s: a decode step now takes %.1f ms, %.1f ms when %s was saved, on a quiet machine: timing again",
                 service_name, decode_ms, profile.curve.forward_ms[0], saved)
        kernel_choices.restore_choices({})
        torch_thread.run(forget_prepared, loaded)
    load = start_profile.MachineLoad()
    torch_thread.run(time_prefill_buckets, loaded, prefill_chunk)
    gathered = torch_thread.run(time_gathered_buckets, loaded, max_sessions)
    curve = torch_thread.run(measure_cost_curve, loaded, cost_curve_rows)
    if key is None or not curve.forward_ms:
        return Timed(curve, gathered, timed=True, keep=False)
    again, busy = decode_step_ms(loaded, curve), others_share(load)
    keep = start_profile.holds(curve, again) and busy < start_profile.QUIET_SHARE
    if not keep:
        log.warning("%s: these timings are not kept as a start profile (a decode step %.1f ms, then %.1f ms at the "
                    "end; other processes used %.0f%% of the cores meanwhile): the next start times again",
                    service_name, curve.forward_ms[0], again, 100 * busy)
    return Timed(curve, gathered, timed=True, keep=keep, replaces=profile is not None)


def forget_prepared(loaded: LoadedModel) -> None:
    """Drop the accelerated kernels' weights the layers made for restored choices
    (`kernel_choices.wanted`): the next call prepares every backend, to be timed again."""
    roots = loaded.lean.linears() if loaded.lean else [loaded.model]
    for root in roots:
        for module in root.modules():
            module.__dict__.pop("_accel", None)
    kernel_choices.state().deferred.clear()


def keep_dense_weights(loaded: LoadedModel, service_name: str) -> int:
    """--prefill-weights dense: the quantized layers hold their dense weight (bf16 or fp32,
    dense_rows.matmul_dtype) for calls of many rows."""
    if not loaded.policy.timed_kernels:   # the dense weights are the timed prefill path's
        return 0
    roots = loaded.lean.linears() if loaded.lean else [getattr(loaded.model, "model", loaded.model)]
    started = time.perf_counter()
    held = torch_thread.run(dense_rows.keep, roots)
    if held:
        log.info("%s: %.2f GB of dense weights kept for prefills (%.1f s; --prefill-weights unpack does without "
                 "them, and prefills unpack each layer per call)", service_name, held / 1e9,
                 time.perf_counter() - started)
    return held


DEFERRED_POLL_S = 1.0       # how often a serving model service looks for kernels left to make
DEFERRED_BUSY_POLL_S = 0.1  # ...and, while requests are in flight, whether they have ended
DEFERRED_PATIENCE_S = 10.0  # requests in flight for this long without a pause: made between their forwards


def prepare_deferred_kernels(service_name: str, stopped: threading.Event,
                             busy: Callable[[], bool] = lambda: False,
                             patience_s: float = DEFERRED_PATIENCE_S) -> threading.Thread:
    """While serving (until `stopped`): make the kernels' weights that restored choices name
    for batches of several sessions only (kernel_choices.Deferred), one layer at a time on
    the torch thread; until each is made its layer runs its own kernel. Most are deferred at
    warm-up; a layer first called by a request defers its own then, and is made within
    DEFERRED_POLL_S.

    A layer is made while nothing is `busy` (no call in progress, no session open): a
    forward that arrives meanwhile waits for the layer on the torch thread (0.1-0.5 s for a
    gate/up of the 1.5B int4 target), and a restart's first request, made to wait between
    its calls, had its first token at 2.0 s against 0.5. Where requests stay in flight for
    `patience_s` without a pause (sustained traffic, whose batches are what these kernels
    are for), the layers are made between their forwards."""
    kernel_state = kernel_choices.state()

    def prepare() -> None:
        made, started, busy_since = 0, 0.0, None
        while not stopped.is_set():
            if not kernel_state.deferred:
                if made:
                    log.info("%s: kernels for batches of several sessions made for %d layers while serving "
                             "(%.1f s, requests' time included)", service_name, made, time.perf_counter() - started)
                    made = 0
                stopped.wait(DEFERRED_POLL_S)
                continue
            if busy():
                busy_since = busy_since or time.monotonic()
                if time.monotonic() - busy_since < patience_s:
                    stopped.wait(DEFERRED_BUSY_POLL_S)
                    continue
            else:
                busy_since = None
            started = started if made else time.perf_counter()
            made += kernel_choices.prepare_deferred(torch_thread.run, kernel_state, limit=1)
    thread = threading.Thread(target=prepare, name="deferred-kernels", daemon=True)
    thread.start()
    return thread
