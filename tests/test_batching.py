"""Continuous batching: the forwards of concurrent calls run as one batched
forward, each call gets exactly its own logits back, batches are sized on the
cost curve in arrival order, and a long prefill runs in chunks between them."""
from __future__ import annotations

import threading

import pytest
import torch

from specdec.runtime import torch_thread
from specdec.runtime.batching import Scheduler, lean_batch_forward
from specdec.runtime.cost_curve import RowCost, gathered_cost
from specdec.runtime.device import EventTimer, HostTimer, policy
from specdec.rpc.errors import ResourceExhausted
from specdec.runtime.sequence import Forward, SequenceCache
from specdec.runtime.kv_pool import KVPool
from specdec.spec.sampling import SamplingConfig
from verifier.target_session import TargetSession

PROMPTS = [[(11 * i + 7 * j) % 500 + 3 for j in range(length)] for i, length in enumerate((5, 17, 40, 9, 64, 3, 28, 12))]


def hold_torch_thread():
    """Keep the torch thread busy until released, so calls submitted meanwhile
    are all pending when the scheduler next looks (one batch, deterministically)."""
    release, busy = threading.Event(), threading.Event()
    torch_thread.submit(lambda: (busy.set(), release.wait(30)))
    busy.wait(10)
    return release


def run_concurrently(scheduler: Scheduler, calls: list) -> list:
    """Each call's steps through the scheduler from its own thread, all pending at once."""
    results: list = [None] * len(calls)

    def one(i: int) -> None:
        try:
            results[i] = scheduler.run(calls[i]())
        except Exception as exc:  # noqa: BLE001 - handed back to the test
            results[i] = exc

    release = hold_torch_thread()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    while scheduler.pending_calls < len(calls):  # every call is in before the forward runs
        threading.Event().wait(0.005)
    release.set()
    for t in threads:
        t.join(30)
    return results


def test_a_batched_forward_gives_each_sequence_its_own_logits(tiny_target):
    lean = tiny_target.lean
    caches, alone = [], []
    for prompt in PROMPTS[:5]:
        cache = lean.new_cache()
        lean(torch.tensor(prompt[:-1]), cache, keep_last=1)                         # a prefix at its own length
        caches.append(cache)
    feeds = [PROMPTS[0][-1:], PROMPTS[1][-1:] + [9, 10, 11], PROMPTS[2][-1:] + [5], list(range(20, 90)),
             PROMPTS[4][-1:]]
    keep = [1, 4, 2, 0, 1]                                                          # 0: a prefill chunk
    for prompt, feed, k in zip(PROMPTS, feeds, keep):
        cache = lean.new_cache()
        lean(torch.tensor(prompt[:-1]), cache, keep_last=1)
        alone.append(lean(torch.tensor(feed), cache, keep_last=max(k, 1))[-k:] if k else None)
    lengths = [c.length for c in caches]
    got = lean.batch([(torch.tensor(f), c, k) for f, c, k in zip(feeds, caches, keep)])
    for i, (g, a, k) in enumerate(zip(got, alone, keep)):
        assert caches[i].length == lengths[i] + len(feeds[i])
        if k:
            assert g.shape == a.shape and torch.allclose(g, a, atol=1e-5), i   # fp32: the same logits
        else:
            assert g.numel() == 0


def test_concurrent_decodes_share_forwards_and_equal_decoding_alone(tiny_target):
    greedy = SamplingConfig()
    alone = [TargetSession(tiny_target, p).decode(12, greedy) for p in PROMPTS]
    sessions = [TargetSession(tiny_target, p) for p in PROMPTS]
    seen: list[tuple[int, int]] = []
    scheduler = Scheduler(lean_batch_forward(tiny_target.lean), on_forward=lambda rows, calls, ms, prefill_rows: seen.append((rows, calls)))
    results = run_concurrently(scheduler, [lambda s=s: s.decode_steps(12, greedy) for s in sessions])
    assert [tokens for tokens, _ in results] == alone
    # All eight were pending together: each forward of the first steps ran them as one batch.
    assert seen[0] == (8, 8) and scheduler.forwards < 8 * 12
    stats = [s for _, s in results]
    assert all(s.forwards == 12 and s.max_rows == 8 and s.mean_calls > 1 for s in stats)


def test_batches_follow_the_cost_curve_in_arrival_order():
    int4_like = RowCost([40.0, 42.0, 47.0, 53.0, 96.0, 99.0, 100.0, 101.0])  # 4 rows a kernel pass
    scheduler = Scheduler(cost=int4_like)

    class Call:
        def __init__(self, rows: int):
            self.pending = Forward(None, tuple(range(rows)), 1)
    five = [Call(1) for _ in range(5)]
    assert scheduler._pick(five) == five[:4]                  # the 5th row would cost as much as 4
    eight = [Call(1) for _ in range(8)]
    assert scheduler._pick(eight) == eight                    # 8 rows: 12.6 ms a row, under 4's 13.3
    assert RowCost([10.0, 20.0, 30.0, 40.0])(6) == 60.0       # past the curve: its upper half's slope...
    assert RowCost([10.0, 10.0, 12.0, 40.0])(8) == 32.0       # ...at most the upper half's best cost per row
    passes = Scheduler(cost=RowCost([40.0, 42.0, 47.0, 53.0, 96.0, 99.0, 100.0, 101.0, 150.0]))
    many = [Call(1) for _ in range(16)]
    assert passes._pick(many) == many                         # a 9th row's new pass does not cap the batch at 8
    # A forward of several calls that runs other kernels than one call's rows (lean's
    # `_gathered`) is priced on its own curve: 8 calls go together where a session's own
    # 8-row verification would have capped the batch at 4.
    gathered = Scheduler(cost=int4_like)
    gathered.batch_cost = gathered_cost(40.0, {2: 45.0, 4: 50.0, 8: 60.0})
    assert gathered.batch_cost(3) == 47.5 and gathered.batch_cost(6) == 55.0   # linear between the rows timed
    assert gathered._pick(five) == five and gathered._pick(eight) == eight
    one_call = [Call(8)]
    assert gathered._pick(one_call) == one_call and gathered_cost(40.0, {}) is None
    # A bucket timed high at warm-up is held to what two smaller batches making it up cost
    # (16 at 300 beside 8 at 100 reads at most 200), and 16 calls still go together.
    held = Scheduler(cost=int4_like)
    held.batch_cost = gathered_cost(31.0, {2: 43.0, 4: 70.0, 8: 100.0, 16: 300.0, 32: 420.0})
    assert held.batch_cost(16) <= 200.0 and held.batch_cost(8) == pytest.approx(100.0)
    assert held._pick(many) == many
    noisy = Scheduler(cost=RowCost([100.0, 100.0, 100.0, 100.0, 104.0]))
    calls = [Call(1) for _ in range(5)]
    assert noisy._pick(calls) == calls                        # 20.8 a row against 25: within the tolerance
    flat = Scheduler(cost=RowCost([100.0] * 8), max_rows=5)
    calls = [Call(2), Call(2), Call(2)]
    assert flat._pick(calls) == calls[:2]                     # within max_rows
    assert flat._pick([Call(9)])[0].pending.feed == tuple(range(9))  # the first always goes


def test_a_long_prefill_runs_in_chunks_with_other_sessions_decoding_between_them(tiny_target):
    greedy = SamplingConfig()
    decoder = TargetSession(tiny_target, PROMPTS[1])
    reference = TargetSession(tiny_target, PROMPTS[1]).decode(6, greedy)
    long_prompt = [(i * 37) % 500 + 3 for i in range(301)]
    prefilling = TargetSession(tiny_target, long_prompt, prefill=False)
    seen: list[tuple[int, int]] = []
    prefill: list[int] = []

    def forwarded(rows, calls, ms, prefill_rows):
        seen.append((rows, calls))
        prefill.append(prefill_rows)
    scheduler = Scheduler(lean_batch_forward(tiny_target.lean), on_forward=forwarded)
    results = run_concurrently(scheduler, [lambda: prefilling.seq.prefill_steps(chunk=64),
                                           lambda: decoder.decode_steps(6, greedy)])
    assert results[1][0] == reference
    assert prefilling.seq.cached == 300                        # all but the last token, in 5 chunks
    assert results[0][1].forwards == 5
    # Each of the decoder's steps shared a forward with a chunk: it waited one chunk at a time.
    assert seen[:5] == [(65, 2)] * 4 + [(45, 2)] and seen[5] == (1, 1)
    assert prefill[:6] == [64] * 4 + [44, 0]                   # the chunks' rows, told apart from the decoder's
    alone = TargetSession(tiny_target, long_prompt)
    assert torch.allclose(prefilling.seq.forward([], 1), alone.seq.forward([], 1), atol=1e-4)


def test_a_failing_call_leaves_the_rest_of_its_batch_alone(tiny_target):
    greedy = SamplingConfig()
    sessions = [TargetSession(tiny_target, p) for p in PROMPTS[:3]]
    reference = [TargetSession(tiny_target, p).decode(3, greedy) for p in PROMPTS[:3]]

    def failing(session):
        yield from session.seq.step([], keep_last=1)
        raise ValueError("the call's own math failed")

    scheduler = Scheduler(lean_batch_forward(tiny_target.lean))
    results = run_concurrently(scheduler, [lambda: sessions[0].decode_steps(3, greedy),
                                           lambda: failing(sessions[1]),
                                           lambda: sessions[2].decode_steps(3, greedy)])
    assert isinstance(results[1], ValueError)
    assert results[0][0] == reference[0] and results[2][0] == reference[2]


def test_a_call_the_kv_pool_refuses_fails_alone(tiny_target):
    greedy = SamplingConfig()
    pool = KVPool(budget_tokens=512, token_bytes=tiny_target.lean.token_bytes())
    small = TargetSession(tiny_target, PROMPTS[0], pool=pool)          # holds one 256-token page
    big = TargetSession(tiny_target, [5] * 200, pool=pool)             # holds the other
    reference = TargetSession(tiny_target, PROMPTS[0]).decode(4, greedy)
    scheduler = Scheduler(lean_batch_forward(tiny_target.lean))
    # The big one's next 100 rows need a third page: refused; the small one decodes on.
    results = run_concurrently(scheduler, [lambda: big.seq.step(list(range(3, 103)), keep_last=1),
                                           lambda: small.decode_steps(4, greedy)])
    assert isinstance(results[0], ResourceExhausted) and "--kv-cache-mb" in str(results[0])
    assert results[1][0] == reference


def test_without_a_scheduler_a_session_drives_its_own_forwards(tiny_target):
    seq = SequenceCache(tiny_target, PROMPTS[2])
    steps = seq.step([1, 2], keep_last=2)
    forward = next(steps)
    assert forward.feed == tuple(PROMPTS[2] + [1, 2]) and forward.keep_last == 2
    with pytest.raises(StopIteration) as done:
        steps.send(forward.run())
    assert done.value.value.shape == (2, tiny_target.model_vocab_size)


class DeviceEvents:
    """A GPU's timing events, the true boundary here: each forward runs `ms` on the device's
    clock, and the device has passed every event but those of the forward queued last."""

    def __init__(self, ms: float):
        self.ms, self.now, self.recorded = ms, 0.0, []

    def event(self):
        device = self

        class Event:
            def record(self):
                self.index = len(device.recorded)
                if self.index % 2:           # a forward's end: the device ran it
                    device.now += device.ms
                self.at = device.now
                device.recorded.append(self)

            def query(self) -> bool:
                return self.index < len(device.recorded) - 2

            def elapsed_time(self, end) -> float:
                return end.at - self.at
        return Event()


def test_a_gpu_s_forwards_are_timed_by_its_events_as_the_device_passes_them(tiny_target):
    """The host's clock reads a GPU forward's launch: the live curve gets the device's ms, each
    once the device has passed its forward, without waiting for it."""
    device = DeviceEvents(ms=40.0)
    seen = []
    scheduler = Scheduler(lean_batch_forward(tiny_target.lean), timer=EventTimer(device.event),
                          on_forward=lambda rows, calls, ms, prefill_rows: seen.append((rows, calls, ms, len(seen))))
    session = TargetSession(tiny_target, PROMPTS[2])
    tokens, _ = run_concurrently(scheduler, [lambda: session.decode_steps(4, SamplingConfig())])[0]
    assert len(tokens) == 4 and scheduler.forwards == 4
    assert seen == [(1, 1, 40.0, 0), (1, 1, 40.0, 1), (1, 1, 40.0, 2)]   # the last forward: not passed yet
    assert isinstance(policy("cuda").forward_timer(), EventTimer)       # what a GPU's services use
    assert isinstance(policy("cpu").forward_timer(), HostTimer)
