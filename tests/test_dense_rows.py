"""Many rows through a quantized layer: the kernel or a dense matmul on the unpacked
weight, chosen once per shape and row bucket by timing both; the two agree."""
from __future__ import annotations

import time

import pytest
import torch

from specdec.runtime import dense_rows, kernel_choices, kernels
from specdec.runtime.quant.int4 import Int4Linear
from specdec.runtime.quant.int8 import Int8WeightOnlyLinear
from tests.test_int4 import random_q4k


@pytest.fixture(autouse=True)
def own_kernels_only(monkeypatch):
    """A layer's own kernel against the dense path: the accelerated ones are tests/test_kernels.py's."""
    monkeypatch.setattr(kernels, "BACKENDS", [])


def int4_layer() -> Int4Linear:
    return Int4Linear.from_q4k(random_q4k(128, 256, seed=3), 128, 256, torch.randn(128))


def int8_layer() -> Int8WeightOnlyLinear:
    return Int8WeightOnlyLinear(torch.randn(128, 256), torch.randn(128))


DTYPES = [torch.bfloat16, torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("make, kind", [(int4_layer, "int4"), (int8_layer, "int8")])
def test_many_rows_run_whichever_path_measured_faster_and_both_agree(monkeypatch, make, kind, dtype, kernel_state):
    monkeypatch.setattr(dense_rows, "matmul_dtype", lambda: dtype)
    layer = make()
    weight = layer.dense_weight().float()
    bias = layer.bias.float()
    x = torch.randn(100, 256)
    first = layer(x)
    key = (kind, 128, 256, "prefill", 128)  # 100 rows: the 65..128 bucket, timed once
    assert set(kernel_state.choices) == {key}
    assert torch.equal(first, layer(x))  # the first call returned the chosen path's output
    reference = x.to(torch.bfloat16).float() @ weight.t() + bias
    bound = 4 * 2.0 ** -8 * (x.abs() @ weight.abs().t() + bias.abs())  # a few bf16 roundings
    for dense in (True, False):
        kernel_state.choices[key] = "dense" if dense else "kernel"
        assert ((layer(x) - reference).abs() <= bound).all(), dense
    layer(torch.randn(dense_rows.MIN_ROWS - 1, 256))
    assert set(kernel_state.choices) == {key}  # fewer rows than MIN_ROWS never ask: the kernel runs


def test_unpack_fills_every_chunk_in_order(monkeypatch):
    monkeypatch.setattr(dense_rows, "CHUNK_ROWS", 3)
    calls = []

    def chunk(start, end):
        calls.append((start, end))
        return torch.arange(start, end, dtype=torch.float32)[:, None].expand(end - start, 2)
    out = dense_rows.unpack(7, 2, torch.bfloat16, chunk)
    assert calls == [(0, 3), (3, 6), (6, 7)]
    assert torch.equal(out[:, 0].float(), torch.arange(7, dtype=torch.float32)) and out.dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_int8_dynamic_layer_takes_finer_activations_on_the_dense_path(monkeypatch, dtype, kernel_state):
    from specdec.runtime.quant.int8 import Int8Linear
    monkeypatch.setattr(dense_rows, "matmul_dtype", lambda: dtype)
    layer = Int8Linear(torch.randn(128, 256), torch.randn(128))
    weight, bias = layer.dense_weight()
    assert weight.dtype == dtype and weight.shape == (128, 256)
    x = torch.randn(100, 256)
    reference = x @ weight.float().t() + bias
    key = ("int8-dynamic", 128, 256, "prefill", 128)
    kernel_state.choices[key] = "dense"
    bf16_bound = 4 * 2.0 ** -8 * (x.abs() @ weight.float().abs().t())
    assert ((layer(x) - reference).abs() <= bf16_bound).all()
    kernel_state.choices[key] = "kernel"  # the kernel: int8 activations, coarser (a step of max|x| / 127 per input)
    kernel_error = (layer(x) - reference).abs()
    assert (kernel_error <= (x.abs().amax() / 127) * weight.float().abs().sum(1)).all()
    kernel_state.choices[key] = "dense"
    assert (layer(x) - reference).abs().mean() < kernel_error.mean()  # bf16 or fp32 activations are the finer


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("make, kind", [(int4_layer, "int4"), (int8_layer, "int8")])
def test_kept_dense_weights_give_the_unpacked_paths_output(monkeypatch, make, kind, dtype, kernel_state):
    kernel_state.choices.update({(kind, 128, 256, "prefill", 128): "dense", (kind, 128, 256, "kept", 128): "dense"})
    monkeypatch.setattr(dense_rows, "matmul_dtype", lambda: dtype)
    layer = make()
    x = torch.randn(100, 256)
    unpacked = layer(x)
    held = dense_rows.keep([layer])
    assert held == 128 * 256 * dtype.itemsize
    built = []
    monkeypatch.setattr(layer, "dense_weight", lambda: built.append(1))  # the kept weight is read, never rebuilt
    assert torch.equal(layer(x), unpacked) and built == []
    assert "_kept_dense" not in layer.state_dict()


@pytest.mark.parametrize("make, kind", [(int4_layer, "int4"), (int8_layer, "int8")])
def test_with_the_dense_weight_kept_calls_under_min_rows_run_the_kernel_and_prefill_sized_ones_are_timed(monkeypatch,
                                                                                                     make, kind,
                                                                                                     kernel_state):
    # The kept weight is the kernel's rounded to bf16: a verify call on it could pick another
    # greedy token than a decode step, so every call a decode or a verification makes stays
    # on the kernel, whatever timing would say.
    layer = make()
    xs = {rows: torch.randn(rows, 256) for rows in (1, 2, 5, 17, dense_rows.MIN_ROWS - 1)}
    kernel = {rows: layer(x) for rows, x in xs.items()}           # no kept weight: the kernel
    dense_rows.keep([layer])
    kept = layer.__dict__["_kept_dense"]
    # A kept weight that would show if any of these calls read it.
    layer.__dict__["_kept_dense"] = tuple(t * 0 if isinstance(t, torch.Tensor) else t for t in kept) \
        if isinstance(kept, tuple) else kept * 0
    for rows, x in xs.items():
        assert torch.equal(layer(x), kernel[rows]), rows
    assert kernel_state.choices == {}                                  # never timed: the kernel, unasked
    layer.__dict__["_kept_dense"] = kept
    layer(torch.randn(dense_rows.MIN_ROWS, 256))
    assert set(kernel_state.choices) == {(kind, 128, 256, "kept", dense_rows.MIN_ROWS)}
    assert set(kernel_state.choices.values()) <= {"kernel", "dense"}


def test_in_a_batched_forward_each_dense_call_runs_on_its_own_rows_and_the_kernels_rows_run_together(monkeypatch, kernel_state):
    # A dense matmul's bits may change with its rows (oneDNN's bf16 matmul on an AMX Xeon
    # changed kernel between 32 and 56 rows of a 1536 x 8960 weight), so two prompts'
    # chunks prefilled in one forward must each get the matmul of its own rows; the
    # kernel's rows (decode steps, verifications: kernels that compute a row the same in
    # a call of any rows) run as one call.
    layer = int4_layer()
    shape = ("int4", 128, 256, "prefill")
    kernel_state.choices[(*shape, kernel_choices.bucket(20))] = "dense"
    kernel_state.choices[(*shape, kernel_choices.bucket(7))] = "dense"
    kernel_state.choices[(*shape, kernel_choices.bucket(5))] = "kernel"
    seen = {"kernel": [], "dense": []}
    for name, method in (("kernel", "_kernel"), ("dense", "_dense")):
        real = getattr(layer, method)
        monkeypatch.setattr(layer, method, lambda x, real=real, name=name: (seen[name].append(x.shape[0]), real(x))[1])
    calls = [20, 1, 7, 5, 2]                # chunks of 20, 7 and 5 rows; a decode step; a 2-row verification
    prefill = [True, False, True, True, False]
    x = torch.randn(sum(calls), 256)
    with dense_rows.by_call(calls, prefill):
        got = layer(x)
    assert sorted(seen["dense"]) == [7, 20] and seen["kernel"] == [1 + 5 + 2]
    alone, start = [], 0
    for rows, chunk in zip(calls, prefill):
        with dense_rows.by_call([rows], [chunk]):
            alone.append(layer(x[start:start + rows]))
        start += rows
    assert torch.equal(got, torch.cat(alone))


@pytest.mark.parametrize("slow", DTYPES)
def test_the_dense_path_multiplies_in_the_dtype_that_measured_faster(monkeypatch, slow):
    def timed(x, weight):  # this dtype's matmul made the slower, whatever this CPU's speed
        if x.dtype == slow:
            time.sleep(0.01)
        return x.new_empty((x.shape[0], weight.shape[0]))
    monkeypatch.setattr(torch.nn.functional, "linear", timed)
    fast = next(d for d in DTYPES if d != slow)
    assert dense_rows.matmul_dtype.__wrapped__() == fast
