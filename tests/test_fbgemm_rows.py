"""fbgemm's int8 GEMM made per row (specdec.runtime.kernels): a row's result never
depends on what shares its call, kept to about 14 bits (two 7-bit passes) where a
layer's input carries outliers, to 8 (row8) where it does not."""
from __future__ import annotations

import pytest
import torch

from specdec.runtime import kernel_choices, kernels
from specdec.runtime.quant import int8
from tests.test_kernels import dequantized

fbgemm_row = next(b for b in kernels.BACKENDS if b.name == "fbgemm-int8-row")
needs_avx2 = pytest.mark.skipif("avx2" not in kernels.cpu_flags(), reason="fbgemm's int8 GEMM runs on AVX2 CPUs")


@needs_avx2
def test_fbgemm_made_per_row_computes_a_row_the_same_whatever_shares_its_call():
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(96, 200, generator=generator)
    scales = weight.abs().amax(dim=1) / 127
    codes = torch.round(weight / scales[:, None]).to(torch.int8)
    state = fbgemm_row.prepare(codes, scales)
    # Rows of very different ranges, one far off zero: a call-wide activation scale would
    # change every row's rounding with its neighbours.
    x = torch.randn(9, 200, generator=generator) * torch.tensor([1, 50, 0.01, 3, 1, 7, 0.5, 2, 1])[:, None]
    x[3] += 40
    x[5, 7] = 300   # an outlier channel
    whole = fbgemm_row.run(state, x)
    assert whole.shape == (9, 96) and whole.dtype == torch.float32
    assert torch.equal(whole, torch.cat([fbgemm_row.run(state, x[r:r + 1]) for r in range(9)]))
    assert torch.equal(whole, torch.cat([fbgemm_row.run(state, x[:4]), fbgemm_row.run(state, x[4:])]))
    # ... and close to the int8 weight's exact product, row by row: each row is kept to
    # about 14 bits (a coarse and a fine 7-bit pass), so one int8 rounding of the activations
    # (about 1e-2 here) would fail this; the row far off zero and the outlier's row too.
    exact = x @ (codes.float() * scales[:, None]).t()
    error = (whole - exact).norm(dim=1) / exact.norm(dim=1)
    assert (error < 1e-3).all(), error
    assert plain_fbgemm_differs_by_call(codes, scales, x)


@needs_avx2
def test_fbgemm_row8_runs_on_the_per_row_weight_keeps_a_row_alone_and_is_offered_only_8_bit_layers():
    generator = torch.Generator().manual_seed(5)
    codes, scales = int8.per_row_int8(torch.randn(96, 256, generator=generator))
    reference = lambda x: x @ (codes.float() * scales[:, None]).t()   # noqa: E731
    offered = dict(kernels.prepared("int8-channel", (codes, scales), reference, per_row=True))
    by_name = {b.name: state for b, state in offered.items()}
    assert by_name["fbgemm-int8-row8"] is by_name["fbgemm-int8-row"]   # one packed weight for both arithmetics
    row8 = next(b for b in offered if b.name == "fbgemm-int8-row8")
    x = torch.randn(7, 256, generator=generator) * torch.tensor([1, 30, 0.02, 2, 1, 9, 0.3])[:, None]
    x[2] -= 5
    whole = row8.run(by_name["fbgemm-int8-row8"], x)
    assert torch.equal(whole, torch.cat([row8.run(by_name["fbgemm-int8-row8"], x[r:r + 1]) for r in range(7)]))
    error = (whole - reference(x)).norm(dim=1) / reference(x).norm(dim=1)
    assert (error < 0.02).all() and (error > 1e-4).any(), error   # one 8-bit rounding of each row, no finer
    down = kernels.prepared("int8-channel", (codes, scales), reference, per_row=True, activation_bits=14)
    assert "fbgemm-int8-row8" not in {b.name for b, _ in down}      # a layer with outlier channels never gets it


def plain_fbgemm_differs_by_call(codes, scales, x) -> bool:
    """fbgemm's own dynamic GEMM scales by the call: the same row alone comes out otherwise."""
    packed = kernels.fbgemm_pack(codes, scales, None)
    alone = torch.ops.quantized.linear_dynamic(x[:1], packed, kernels.reduce_range())
    together = torch.ops.quantized.linear_dynamic(x, packed, kernels.reduce_range())[:1]
    return not torch.equal(alone, together)


@needs_avx2
def test_an_int8_weight_only_head_offered_int8_activations_takes_fbgemm_per_row_where_it_passes(registry):
    registry.register(fbgemm_row)
    generator = torch.Generator().manual_seed(4)
    head = int8.Int8WeightOnlyLinear(torch.randn(256, 64, generator=generator), int8_activations=True)
    assert [b.name for b, _ in head._accelerated()] == ["fbgemm-int8-row"]
    x = torch.randn(5, 64, generator=generator).bfloat16()
    out = head(x)
    assert torch.equal(out, torch.cat([head(x[r:r + 1]) for r in range(5)]))  # one kernel for every row count
    assert any("every call" in line for line in kernel_choices.choices())


def test_a_layer_whose_input_carries_outliers_takes_only_backends_that_keep_enough_bits(registry):
    # An 8-bit per-row backend (as zentorch's) loses an outlier channel's neighbours: a down
    # projection asks for 14 bits, and gets only the backends that keep them.
    coarse = kernels.Backend("coarse", "int8-channel", "torch", dequantized, lambda w, x: x @ w.t(), per_row=True)
    fine = kernels.Backend("fine", "int8-channel", "torch", dequantized, lambda w, x: x @ w.t(), per_row=True,
                           activation_bits=14)
    registry.register(coarse)
    registry.register(fine)
    generator = torch.Generator().manual_seed(5)
    weight = torch.randn(64, 32, generator=generator)
    down = int8.Int8WeightOnlyLinear(weight, int8_activations=True, activation_bits=14)
    head = int8.Int8WeightOnlyLinear(weight, int8_activations=True)
    assert [b.name for b, _ in down._accelerated()] == ["fine"]
    assert [b.name for b, _ in head._accelerated()] == ["coarse", "fine"]
    assert fbgemm_row.activation_bits == 14
    assert all(b.activation_bits == 8 for b in kernels.BACKENDS if b.module == "zentorch")
