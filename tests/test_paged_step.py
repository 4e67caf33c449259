"""The static step over one KV arena (the CUDA path's step, run here on the CPU in
fp32): the lean forward's logits for decode, verification, batches of sessions at
different lengths, rollback and shared prefix pages; padding rows that change no
real row; no graph break, no host sync inside a step; an arena that never moves."""
from __future__ import annotations

import time

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from specdec.rpc.errors import InvalidArgument, ResourceExhausted
from specdec.runtime import lean
from specdec.runtime.kv_arena import PAGE_TOKENS, SCRATCH_PAGE, KVArena
from specdec.runtime.models import load_model
from specdec.runtime.paged_step import PagedRunner
from tests.conftest import NoHostReads

ATOL = 5e-5   # fp32 sums in SDPA's order against the lean forward's bmm: 1e-5 apart on logits of size ~5


def runner_for(forward: lean.LeanForward, pages: int = 64, max_context: int = 256) -> PagedRunner:
    arena = KVArena(len(forward.layers), forward.kv_heads, forward.head_dim, pages, torch.float32, "cpu")
    return PagedRunner(forward, arena, max_context)


@pytest.fixture(scope="module")
def forward() -> lean.LeanForward:
    # A model of its own: the step fuses q/k/v and gate/up, making the layers' weights views.
    return load_model("tiny-target").lean


@pytest.fixture(scope="module")
def qwen_forward() -> lean.LeanForward:
    config = Qwen2Config(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    return lean.LeanForward(Qwen2ForCausalLM(config).eval())   # q/k/v with biases, fused with them


def lean_logits(forward: lean.LeanForward, calls: list[tuple[list[int], int]], crop: dict[int, int] = {}):
    """The lean forward over the same calls: [(ids, rows kept)], the cache cropped before call i to crop[i]."""
    cache, out = forward.new_cache(), []
    for i, (ids, keep) in enumerate(calls):
        if i in crop:
            cache.crop(crop[i])
        out.append(forward(torch.tensor(ids), cache, keep_last=keep))
    return out


@pytest.mark.parametrize("model", ["forward", "qwen_forward"])
def test_prefill_decode_verify_and_rollback_give_the_lean_forwards_logits(model, request):
    forward = request.getfixturevalue(model)
    runner = runner_for(forward)
    tokens = [(7 * i + 3) % 250 + 5 for i in range(60)]
    calls = [(tokens[:30], 30), (tokens[30:31], 1), (tokens[31:36], 5), ([9, 10, 11], 3)]
    expected = lean_logits(forward, calls, crop={3: 33})         # two of five drafts kept, then a verification
    sequence = runner.arena.new_sequence()
    for i, (ids, keep) in enumerate(calls):
        if i == 3:
            sequence.crop(33)
        got = runner.forward([(ids, sequence, keep)])[0]
        assert got.shape == expected[i].shape
        assert torch.allclose(got, expected[i], atol=ATOL), (i, (got - expected[i]).abs().max())
        assert torch.equal(got.argmax(-1), expected[i].argmax(-1))
    assert sequence.length == 36 and len(sequence.pages) == 3


def test_a_rollback_under_a_context_bucket_reads_the_smaller_bucket(forward):
    # 260 positions hold 17 pages (a 32-page context); rolled back to 250 the session keeps
    # them, while its step reads 16 (the pages past them hold only the rejected rows).
    runner = runner_for(forward, max_context=512)
    tokens = [(7 * i + 3) % 250 + 5 for i in range(270)]
    sequence = runner.arena.new_sequence()
    runner.forward([(tokens[:256], sequence, 0)])
    runner.forward([(tokens[256:260], sequence, 4)])
    assert len(sequence.pages) == 17 and runner.context_pages(260) == 32
    sequence.crop(250)
    got = runner.forward([([tokens[250]], sequence, 1)])[0]
    assert runner.context_pages(251) == 16 and len(sequence.pages) == 17
    assert torch.allclose(got, lean_logits(forward, [(tokens[:251], 1)])[0], atol=ATOL)


def test_sessions_at_different_lengths_share_a_step_and_padding_changes_no_real_row(forward):
    runner = runner_for(forward)
    prompts = [[(11 * i + j) % 240 + 4 for i in range(length)] for j, length in enumerate((5, 40, 17))]
    nexts = [[8], [21, 22, 23], [30, 31]]                        # a decode, a verification of 3, of 2
    sequences = [runner.arena.new_sequence() for _ in prompts]
    for prompt, sequence in zip(prompts, sequences):
        runner.forward([(prompt, sequence, 0)])                   # prefills: no logits kept
    scratch = slice(SCRATCH_PAGE * PAGE_TOKENS, (SCRATCH_PAGE + 1) * PAGE_TOKENS)
    before = runner.arena.keys.clone()
    got = runner.forward([(ids, sequence, len(ids)) for ids, sequence in zip(nexts, sequences)])  # 6 rows: bucket 8
    assert runner.bucket(6) == 8
    for prompt, ids, logits in zip(prompts, nexts, got):
        expected = lean_logits(forward, [(prompt, 0), (ids, len(ids))])[1]
        assert torch.allclose(logits, expected, atol=ATOL)
    # The two padding rows wrote the scratch page alone: every other slot changed only at the rows' own.
    written = {sequence.pages[p // PAGE_TOKENS] * PAGE_TOKENS + p % PAGE_TOKENS
               for sequence, ids in zip(sequences, nexts)
               for p in range(sequence.length - len(ids), sequence.length)}
    changed = (runner.arena.keys != before).flatten(2).any(-1).any(0).nonzero().flatten().tolist()
    assert set(changed) - set(range(scratch.start, scratch.stop)) == written


def test_a_shared_prefixs_pages_are_shared_and_given_back_with_their_last_holder(forward):
    runner = runner_for(forward, pages=16)
    arena = runner.arena
    prompt = [(5 * i + 1) % 230 + 6 for i in range(2 * PAGE_TOKENS + 5)]
    first = arena.new_sequence()
    runner.forward([(prompt, first, 0)])
    free = arena.free_pages
    second = arena.fork(first, 2 * PAGE_TOKENS)                  # the first two pages, not copied
    assert second.pages == first.pages[:2] and arena.free_pages == free
    tail = [40, 41, 42]
    got = runner.forward([(tail, second, 3)])[0]
    expected = lean_logits(forward, [(prompt[:2 * PAGE_TOKENS] + tail, 3)])[0]
    assert torch.allclose(got, expected, atol=ATOL)
    assert len(second.pages) == 3 and arena.free_pages == free - 1     # its own third page
    again = runner.forward([([7], first, 1)])[0]                  # the first session's own tail is intact
    assert torch.allclose(again, lean_logits(forward, [(prompt + [7], 1)])[0], atol=ATOL)
    arena.release(first)
    assert arena.free_pages == free - 1 + 1                       # its third page; the shared two still held
    arena.release(second)
    assert arena.free_pages == 15                                 # every page but the scratch page


def test_one_sessions_rows_gather_its_context_once_and_several_sessions_rows_their_own(forward, monkeypatch):
    """A verification's k rows would read their session's keys and values k times, one gather a
    row: one call's rows (padded to their bucket) share one gather, and give what one gather a row
    gives; rows of several sessions, or a single row, gather their own."""
    runner = runner_for(forward)
    seen = []
    step = runner.step.__call__

    def spy(ids, positions, tables, shared=False):
        seen.append((ids.shape[0], shared))
        return step(ids, positions, tables, shared)
    monkeypatch.setattr(runner, "_bucket_step", spy)
    tokens = [(5 * i + 2) % 240 + 7 for i in range(50)]
    first, second = runner.arena.new_sequence(), runner.arena.new_sequence()
    runner.forward([(tokens[:40], first, 1)])
    runner.forward([(tokens[:20], second, 1)])
    seen.clear()
    verify = runner.forward([(tokens[40:45], first, 5)])[0]       # 5 rows in the bucket of 8
    first.crop(40)
    inputs = runner._inputs_for(8, runner.context_pages(45))       # the same call's buffers, one gather a row
    with torch.inference_mode():
        apart = runner.step(*inputs, shared=False)[:5]
    runner.forward([(tokens[40:41], first, 1)])
    runner.forward([(tokens[41:44], first, 3), (tokens[20:22], second, 2)])
    assert seen == [(8, True), (1, False), (8, False)]
    assert torch.allclose(verify, apart, atol=1e-5)
    assert torch.allclose(verify, lean_logits(forward, [(tokens[:40], 1), (tokens[40:45], 5)])[1], atol=ATOL)


def test_a_step_compiles_whole_and_syncs_nothing_and_the_arena_never_moves(forward):
    runner = runner_for(forward)
    arena = runner.arena
    addresses = (arena.keys.data_ptr(), arena.values.data_ptr())
    sequence = arena.new_sequence()
    runner.forward([(list(range(10, 40)), sequence, 1)])
    inputs = runner._inputs_for(runner.bucket(3), runner.context_pages(33))
    runner.forward([([50, 51, 52], sequence, 3)])                 # the bucket's buffers now hold a real call
    sequence.crop(30)                                             # and again from where that call started

    with torch.inference_mode(), NoHostReads():
        eager = runner.step(*inputs)
    with torch.inference_mode():
        compiled = torch.compile(runner.step, fullgraph=True, backend="aot_eager")(*inputs)   # raises on a break
    assert torch.allclose(compiled, eager, atol=1e-5)
    for _ in range(3):                                            # pages taken, given back, shared
        other = arena.fork(sequence, 16)
        runner.forward([(list(range(60, 60 + 40)), other, 1)])
        arena.release(other)
    assert (arena.keys.data_ptr(), arena.values.data_ptr()) == addresses


def test_a_full_arena_and_a_table_too_short_are_refused_with_what_to_do(forward):
    runner = runner_for(forward, pages=3, max_context=128)        # two pages to hand out
    sequence = runner.arena.new_sequence()
    runner.forward([(list(range(4, 36)), sequence, 1)])           # 32 tokens: both pages
    with pytest.raises(ResourceExhausted, match="free pages"):
        runner.forward([([5], sequence, 1)])
    assert sequence.length == 32                                  # nothing moved
    wide = runner_for(forward, pages=64, max_context=32)
    long = wide.arena.new_sequence()
    with pytest.raises(InvalidArgument, match="tables reach 32"):
        wide.forward([(list(range(4, 40)), long, 1)])


def test_calls_past_the_largest_bucket_run_in_groups_and_a_long_prefill_gathers_its_context_once(forward):
    runner = runner_for(forward, pages=128, max_context=512)
    prompts = [[(3 * i + j) % 200 + 9 for i in range(length)] for j, length in enumerate((150, 40, 30))]
    sequences = [runner.arena.new_sequence() for _ in prompts]
    # 220 rows: the 150-row prefill alone (eager, one gathered context), the others in buckets of 32 and 64.
    got = runner.forward([(prompt, sequence, 2) for prompt, sequence in zip(prompts, sequences)])
    for prompt, logits in zip(prompts, got):
        assert torch.allclose(logits, lean_logits(forward, [(prompt, 2)])[0], atol=ATOL)
    assert runner.context_pages(150) == 16 and runner.context_pages(300) == 32 and runner.context_pages(10**4) == 32


def test_an_inductor_compiled_step_writes_the_arena_in_place_whatever_its_size(forward):
    """The arena is the compiled step's input: a write through a view of it (keys[layer]) was
    left functional by inductor, a pass over the whole arena every step (39 ms a step of
    this model over a 64 MiB arena on the CPU, and on a GPU the services' arena is most of
    its memory). A step over an arena 256 times larger (128 MiB) must cost what it costs
    over a small one: the pass would add 80 ms a step here, and 20 ms or more on any
    machine; the step itself takes a few."""
    def step_ms(pages: int) -> float:
        arena = KVArena(len(forward.layers), forward.kv_heads, forward.head_dim, pages, torch.float32, "cpu")
        runner = PagedRunner(forward, arena, 128, buckets=(4,), compile="inductor")
        sequence = arena.new_sequence()
        runner.forward([(list(range(10, 40)), sequence, 1)])
        best = float("inf")
        for _ in range(5):                      # the first compiles
            sequence.crop(30)
            started = time.perf_counter()
            logits = runner.forward([([50, 51, 52], sequence, 3)])[0]
            best = min(best, time.perf_counter() - started)
        assert torch.allclose(logits, lean_logits(forward, [(list(range(10, 40)) + [50, 51, 52], 3)])[0], atol=ATOL)
        return best * 1e3

    small, large = step_ms(32), step_ms(32 * 256)
    assert large < 2 * small + 5, f"{large:.1f} ms a step over the large arena, {small:.1f} over the small one"


def test_a_compiled_step_compiles_once_a_row_bucket_whatever_the_context(forward):
    """Its context is dynamic: a session growing past a context bucket must not compile the
    step again (tens of seconds on a GPU, in the middle of a request), the widest bucket
    (the whole block table) included. Counted by a backend that runs the captured graph."""
    compiled: list[int] = []

    def counting(graph, example_inputs):
        compiled.append(example_inputs[0].shape[0] if example_inputs else 0)
        return graph.forward

    arena = KVArena(len(forward.layers), forward.kv_heads, forward.head_dim, 256, torch.float32, "cpu")
    runner = PagedRunner(forward, arena, 1024, buckets=(1, 4), compile=counting)
    sequence = arena.new_sequence()
    prompt = [(7 * i + 3) % 200 for i in range(1000)]
    done, contexts = 0, set()
    for length in (200, 400, 700, 1000):          # context buckets of 16, 32, 64 and 64 = every page
        runner.forward([(prompt[done:length], sequence, 0)])   # prefill chunks: eager, not compiled
        done = length
        for rows in (1, 3):
            step = prompt[length - rows:length]
            sequence.crop(length - rows)
            got = runner.forward([(step, sequence, rows)])[0]
            assert torch.allclose(got, lean_logits(forward, [(prompt[:length], rows)])[0], atol=ATOL)
        contexts.add(runner.context_pages(length))
    assert contexts == {16, 32, 64} and runner.max_pages == 64
    assert len(compiled) == 2, compiled            # the 1-row bucket and the 4-row one
