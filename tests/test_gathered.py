"""Forwards that gather several sessions' rows (the default, not --batch-invariant): their
prefill chunks share one call of each layer, and decode rows past position 0 may take a
layer's fewer-bit kernels (the gate/up projections' 8-bit pass), chosen apart."""
from __future__ import annotations

import time

import torch

from specdec.runtime import dense_rows, kernel_choices, kernels
from tests.test_lean import _tiny_int4_forward


def backend(name: str, bits: int, delay_s: float) -> kernels.Backend:
    def run(weight, x):
        time.sleep(delay_s)
        return x @ weight.t()
    return kernels.Backend(name, "int8-channel", "torch", lambda codes, scales: codes, run, per_row=True,
                           activation_bits=bits)


def test_a_layers_fewer_bit_kernel_serves_gathered_decode_rows_alone(kernel_state):
    # The fastest kernel keeps 8 bits of a row where the layer's calls need 14: it may run
    # only in batches of decode rows (`gathered(decode_rows=True)`), under a key of its own.
    weight = torch.randn(16, 8)
    fewer = [(backend("eight", 8, 0.0), weight)]
    accel = [(backend("fourteen", 14, 0.004), weight)]

    def own(x):
        time.sleep(0.008)
        return x @ weight.t()
    key, x = ("int4", 16, 8), torch.randn(3, 8)
    kernel_choices.pick_per_layer(key, x, "own", own, accel, fewer)
    with kernel_choices.gathered():
        kernel_choices.pick_per_layer(key, x, "own", own, accel, fewer)
    with kernel_choices.gathered(decode_rows=True):
        kernel_choices.pick_per_layer(key, x, "own", own, accel, fewer)
    choices = kernel_state.choices
    assert choices[(*key, 0)] == "fourteen" and choices[(*key, "gathered", 3)] == "fourteen"
    assert choices[(*key, "gathered-decode", 3)] == "eight"
    # A layer with no fewer-bit kernel keeps the gathered choices of every batch.
    with kernel_choices.gathered(decode_rows=True):
        kernel_choices.pick_per_layer(("int4", 4, 8), x, "own", own, [(accel[0][0], torch.randn(4, 8))])
    assert ("int4", 4, 8, "gathered", 3) in choices and ("int4", 4, 8, "gathered-decode", 3) not in choices


def test_which_batches_may_take_fewer_bits_and_prefill_chunks_share_each_layers_call(monkeypatch):
    forward = _tiny_int4_forward()
    seen, calls = [], []
    real_gathered, real_by_call = kernel_choices.gathered, dense_rows.by_call
    monkeypatch.setattr(kernel_choices, "gathered", lambda decode_rows=False: (seen.append(decode_rows),
                                                                               real_gathered(decode_rows))[1])
    monkeypatch.setattr(dense_rows, "by_call", lambda rows, prefill=None: (calls.append((list(rows), prefill)),
                                                                           real_by_call(rows, prefill))[1])
    prompts = [list(range(3 + j, 23 + j)) for j in range(3)]
    alone = []
    for prompt in prompts:                      # each session alone: its prefill, then one decode row
        cache = forward.new_cache()
        forward(torch.tensor(prompt), cache, keep_last=0)
        alone.append(forward(torch.tensor([9]), cache, keep_last=1))
    assert seen == []                           # one session: never gathered
    caches = [forward.new_cache() for _ in prompts]
    calls.clear()
    forward.batch([(torch.tensor(p), c, 0) for p, c in zip(prompts, caches)])       # three prefill chunks
    assert seen == [False] and calls[0] == ([60], [True])                           # one call of 60 rows
    got = forward.batch([(torch.tensor([9]), c, 1) for c in caches])                # three decode rows
    assert seen == [False, True]
    for mine, theirs in zip(got, alone):        # bf16 int4 layers on other kernels: within roundings
        assert torch.allclose(mine, theirs, atol=0.05 * float(theirs.abs().max()))
    # A session at position 0 beside another's decode row: no fewer bits (the attention sink's row).
    first = forward.new_cache()
    forward.batch([(torch.tensor([5]), first, 1), (torch.tensor([10]), caches[0], 1)])
    assert seen[-1] is False
