"""Continuous batching: the forwards of many sessions' calls, run as one.

A model service's calls (StartSession's prefill, Propose's draft steps, Verify,
Decode) are generators of `Forward` steps (specdec.runtime.sequence): each yields the
rows it needs the model to run and receives their logits. A call hands its
generator to the Scheduler and waits. On the process's torch thread the
scheduler keeps every call in flight at the Forward it waits on, runs the
pending forwards as one batched forward (`LeanForward.batch`: the Linear layers
once over all the rows, attention per session over its own cache), then sends
each call its logits, which runs the call's own math (sampling, the rejection
sampler) up to its next Forward or its end. A call that arrives while a forward
runs joins the next one: nobody waits for a batch to fill, and nobody waits for
another call to finish.

Which pending forwards go into a batch: in the order they became pending (the
one that waited longest first, so no call starves), as many as keep the cost
per row lowest on the service's measured cost curve (`CostCurve`, measured at
warm-up): torch's int4 kernel takes 4 rows a pass, so a 5th row can cost as
much as the first four, and is better left to the next forward. A batch of
several calls is priced on its own curve where it runs other kernels
(`batch_cost`, lean's `_gathered`): an int8 GEMM's 8 rows cost little more than 1.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, TypeVar

import torch

from specdec.runtime import torch_thread
from specdec.runtime.device import EventTimer, HostTimer
from specdec.runtime.sequence import Forward, Steps, run_steps

T = TypeVar("T")
log = logging.getLogger(__name__)
TOLERANCE = 0.1  # cost per row within this of the best counts as as good: timings this close are noise


@dataclass
class CallStats:
    """What the scheduler did for one call: reported back in its response."""
    forwards: int = 0
    rows: int = 0            # summed over its forwards: the rows of every call in them
    max_rows: int = 0        # the largest forward it was part of
    calls: int = 0           # summed over its forwards: the calls in them (itself included)
    queue_ms: float = 0.0    # summed: from being pending to its forward starting

    @property
    def mean_calls(self) -> float:
        return self.calls / self.forwards if self.forwards else 0.0


@dataclass(eq=False)
class _Call:
    steps: Steps
    done: threading.Event = field(default_factory=threading.Event)
    pending: Forward | None = None
    ready_at: float = 0.0
    result: object = None
    error: BaseException | None = None
    stats: CallStats = field(default_factory=CallStats)


class Scheduler:
    """Runs calls' forwards in batches on the torch thread; see the module doc."""

    def __init__(self, batch_forward: Callable[[list[Forward]], list[torch.Tensor]] | None = None,
                 max_rows: int = 256, cost: Callable[[int], float] | None = None,
                 on_forward: Callable[[int, int, float, int], None] = lambda rows, calls, ms, prefill_rows: None,
                 timer: HostTimer | EventTimer | None = None):
        # batch_forward(forwards) -> their logits, one forward; None: each forward alone.
        self.batch_forward = batch_forward
        self.max_rows = max_rows
        self.cost = cost                  # ms by rows; None: take every pending forward
        # ms by rows of a forward gathering several calls, where it runs other kernels than one
        # call's rows (lean's `_gathered`); None: `cost` prices those too.
        self.batch_cost: Callable[[int], float] | None = None
        # (rows, calls, ms, prefill_rows: those of prefill chunks) after each forward: the live cost curve
        self.on_forward = on_forward
        # What reads a forward's ms: the device's policy's (a GPU's arrive a forward or more late).
        self.timer = timer or HostTimer()
        self._lock = threading.Lock()
        self._incoming: list[_Call] = []
        self._active: list[_Call] = []    # torch thread only
        self._scheduled = False
        self.forwards = 0
        self.forward_rows = 0

    def run(self, steps: Steps[T]) -> tuple[T, CallStats]:
        """Run a call's steps to the end, its forwards batched with other calls';
        blocks the calling thread. Returns the call's result and what it waited."""
        if torch_thread.on_it():  # warm-up and tools on the torch thread itself: alone, inline
            return run_steps(steps), CallStats()
        call = _Call(steps)
        with self._lock:
            self._incoming.append(call)
            if not self._scheduled:
                self._scheduled = True
                torch_thread.submit(self._turn)
        call.done.wait()
        if call.error is not None:
            raise call.error
        return call.result, call.stats

    @property
    def pending_calls(self) -> int:
        with self._lock:
            return len(self._incoming) + len(self._active)

    # --- on the torch thread -------------------------------------------------

    def _turn(self) -> None:
        """One forward's worth of work, then this schedules itself again while any
        call is in flight (so other work queued for the torch thread interleaves).
        Whatever raises in here, the scheduler stays consistent: the calls it was
        running hear the error, and the next call schedules a turn again."""
        try:
            with self._lock:
                incoming, self._incoming = self._incoming, []
            self._active += incoming
            for call in incoming:
                self._advance(call, lambda c: next(c.steps))
            self._active = [c for c in self._active if c.pending is not None]
            if self._active:
                self._forward(self._pick(sorted(self._active, key=lambda c: c.ready_at)))
                self._active = [c for c in self._active if c.pending is not None]
        except BaseException as exc:  # a bug of the scheduler's own (its cost curve, say): fail its calls, not itself
            for call in self._active:
                self._finish(call, error=exc)
            self._active = []
        finally:
            with self._lock:
                if self._active or self._incoming:
                    torch_thread.submit(self._turn)
                else:
                    self._scheduled = False

    def _pick(self, waiting: list[_Call]) -> list[_Call]:
        """The longest-waiting calls, as many as run within TOLERANCE of the lowest
        cost per row (so the larger batch wins over timing noise), within max_rows
        (the first always goes). A row left out is not saved, only deferred: it
        pays to leave it only where it would start a whole new kernel pass."""
        rows, per_row = 0, []
        for k, call in enumerate(waiting, start=1):
            rows += len(call.pending.feed)
            if k > 1 and rows > self.max_rows:
                break
            cost = self.batch_cost if k > 1 and self.batch_cost is not None else self.cost
            per_row.append(cost(rows) / rows if cost is not None else 0.0)
        best = min(per_row)
        return waiting[:max(k for k, cost in enumerate(per_row, start=1) if cost <= best * (1 + TOLERANCE))]

    def _forward(self, batch: list[_Call]) -> None:
        started = time.perf_counter()
        # KV pages first: a call the pool refuses leaves the batch, not the batch with it.
        ready = []
        for call in batch:
            seq = call.pending.seq
            try:
                if hasattr(seq.cache, "reserve"):
                    seq.cache.reserve(seq.cached + len(call.pending.feed))
            except BaseException as exc:
                self._advance(call, lambda c, e=exc: c.steps.throw(e))
                continue
            ready.append(call)
        if not ready:
            return
        rows = sum(len(c.pending.feed) for c in ready)
        for call in ready:
            s = call.stats
            s.forwards, s.rows, s.max_rows = s.forwards + 1, s.rows + rows, max(s.max_rows, rows)
            s.calls += len(ready)
            s.queue_ms += (started - call.ready_at) * 1e3
        if self.batch_forward is not None and len(ready) > 1:
            mark = self.timer.start()
            try:
                outputs = self.batch_forward([c.pending for c in ready])
            except Exception:
                # One call's rows can fail a batch (a bad id, out of memory): run each
                # alone, so only the call that fails hears of it. A batched forward
                # that fails leaves every cache as it was (LeanForward.batch).
                outputs = None
            if outputs is not None:
                self._forwarded(rows, len(ready), mark,
                                sum(len(c.pending.feed) for c in ready if c.pending.keep_last == 0))
                for call, logits in zip(ready, outputs):
                    self._advance(call, lambda c, out=logits: c.steps.send(out))
                return
        for call in ready:
            mark = self.timer.start()
            try:
                logits = call.pending.run()
            except BaseException as exc:
                self._advance(call, lambda c, e=exc: c.steps.throw(e))
                continue
            feed = len(call.pending.feed)
            self._forwarded(feed, 1, mark, feed if call.pending.keep_last == 0 else 0)
            self._advance(call, lambda c, out=logits: c.steps.send(out))

    def _forwarded(self, rows: int, calls: int, mark, prefill_rows: int) -> None:
        self.forwards += 1
        self.forward_rows += rows
        try:
            for (rows_, calls_, prefill_), ms in self.timer.stop(mark, (rows, calls, prefill_rows)):
                self.on_forward(rows_, calls_, ms, prefill_)
        except Exception:  # metrics must never fail a call
            log.exception("the scheduler's on_forward hook failed")

    @classmethod
    def _advance(cls, call: _Call, step: Callable[[_Call], Forward]) -> None:
        """Run the call's own code up to its next Forward, or to its end."""
        try:
            pending = step(call)
            if not isinstance(pending, Forward):
                raise TypeError(f"a call's steps yielded {type(pending).__name__}, not a Forward")
            call.pending, call.ready_at = pending, time.perf_counter()
        except StopIteration as done:
            cls._finish(call, result=done.value)
        except BaseException as exc:
            cls._finish(call, error=exc)

    @staticmethod
    def _finish(call: _Call, result: object = None, error: BaseException | None = None) -> None:
        call.result, call.error, call.pending = result, error, None
        call.done.set()


def lean_batch_forward(lean) -> Callable[[list[Forward]], list[torch.Tensor]]:
    """The batched forward over a LeanForward: each Forward's rows at its own cache's positions."""
    def run(forwards: list[Forward]) -> list[torch.Tensor]:
        return lean.batch([(lean.feed_ids(f.feed, f.ids), f.seq.cache, f.keep_last) for f in forwards])
    return run
