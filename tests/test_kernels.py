"""specdec.runtime.kernels: accelerated backends behind one interface, skipped
where they do not install or fail their check, chosen per shape and row bucket
by timing; a quantized layer gives the same result whichever runs."""
from __future__ import annotations

import io
import logging
import pickle
import time

import pytest
import torch

from specdec.runtime import kernels
from specdec.runtime.quant import int8


@pytest.fixture
def registry(monkeypatch):
    monkeypatch.setattr(kernels, "BACKENDS", [])
    monkeypatch.setattr(kernels, "_usable", {})
    monkeypatch.setattr(kernels, "_CHOICE", {})
    monkeypatch.setattr(kernels, "_FAILED", set())
    return kernels


def dequantized(codes, scales):
    return codes.float() * scales[:, None]


def exact(name: str, delay_s: float = 0.0) -> kernels.Backend:
    """A backend computing the layer's int8 weight in fp32: the same result, at a chosen speed."""
    def run(weight, x):
        time.sleep(delay_s)
        return x @ weight.t()
    return kernels.Backend(name, "int8-channel", "torch", dequantized, run)


def layer(generator) -> int8.Int8Linear:
    return int8.Int8Linear(torch.randn(64, 32, generator=generator), torch.randn(64, generator=generator))


def test_a_backend_that_does_not_install_is_skipped_with_a_line_and_the_layer_runs_as_before(registry, caplog):
    registry.register(kernels.Backend("missing", "int8-channel", "specdec_no_such_package", dequantized,
                                      lambda w, x: x))
    generator = torch.Generator().manual_seed(0)
    with caplog.at_level(logging.INFO, logger="specdec.runtime.kernels"):
        linear = layer(generator)
        x = torch.randn(3, 32, generator=generator)
        y = linear(x)
    assert "kernel backend missing skipped" in caplog.text and "specdec_no_such_package" in caplog.text
    assert linear._accelerated() == [] and registry._CHOICE == {}
    expected = torch.ops.quantized.linear_dynamic(x, linear._packed, int8._reduce_range())
    assert torch.equal(y, expected)


def test_a_backend_that_fails_its_check_is_skipped_for_that_shape_with_a_warning(registry, caplog):
    # Wrong from an inner size of 48 (as zentorch's int8 GEMM is from 4,096), right below it.
    registry.register(kernels.Backend("wrong", "int8-channel", "torch", dequantized,
                                      lambda w, x: (2 if x.shape[1] >= 48 else 1) * x @ w.t()))
    generator = torch.Generator().manual_seed(1)
    with caplog.at_level(logging.WARNING, logger="specdec.runtime.kernels"):
        wide = [int8.Int8Linear(torch.randn(64, 64, generator=generator)) for _ in range(2)]
        for linear in wide:
            linear(torch.randn(2, 64))
        narrow = layer(generator)
        narrow(torch.randn(2, 32))
    assert all(linear._accelerated() == [] for linear in wide)
    assert caplog.text.count("wrong skipped for 64 x 64 layers: it failed its check") == 1   # said once a shape
    assert [b.name for b, _ in narrow._accelerated()] == ["wrong"]   # the shapes it computes rightly keep it


def test_the_faster_kernel_is_chosen_per_row_bucket_and_kept(registry):
    registry.register(exact("slow", delay_s=0.02))
    registry.register(exact("quick"))
    generator = torch.Generator().manual_seed(2)
    linear = layer(generator)
    x = torch.randn(5, 32, generator=generator)
    y = linear(x)
    assert [b.name for b, _ in linear._accelerated()] == ["slow", "quick"]
    key = ("int8-dynamic", 64, 32, kernels.bucket(5))
    assert registry._CHOICE[key] in ("quick", "fbgemm-int8")    # never the one that sleeps
    assert any("rows<=5" in line for line in registry.choices())
    # The same bucket again: no new timing, the same kernel (a chosen kernel is deterministic).
    started = time.perf_counter()
    again = linear(x)
    assert time.perf_counter() - started < 0.02 and torch.equal(again, y)
    # Every kernel gives the layer's result within int8 roundings (bias included).
    reference = torch.ops.quantized.linear_dynamic(x, linear._packed, int8._reduce_range())
    assert float((y - reference).norm() / reference.norm()) < kernels.CHECK_TOLERANCE


def test_row_buckets_are_exact_to_eight_then_powers_of_two():
    assert [kernels.bucket(r) for r in (1, 4, 5, 8, 9, 16, 17, 64, 65)] == [1, 4, 5, 8, 16, 16, 32, 64, 128]


def test_the_model_cache_saves_a_layer_without_this_machines_kernels(registry):
    registry.register(exact("quick"))
    linear = layer(torch.Generator().manual_seed(3))
    linear(torch.randn(1, 32))
    assert linear._accelerated()
    buffer = io.BytesIO()
    torch.save(linear, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert "_accel" not in loaded.__dict__ and "_accel" not in pickle.loads(pickle.dumps(linear)).__dict__
    x = torch.randn(2, 32)
    assert torch.allclose(loaded(x), linear(x), rtol=0, atol=1e-5)


def test_a_backend_that_raises_in_serving_is_left_out_and_the_call_goes_on(registry, caplog):
    def flaky(weight, x):
        if x.shape[0] in (2, 3):   # passes its check (4 rows), then fails at 2 and 3 rows
            raise RuntimeError("unsupported shape")
        return x @ weight.t()
    registry.register(kernels.Backend("flaky", "int8-channel", "torch", dequantized, flaky))
    registry.register(exact("quick"))
    generator = torch.Generator().manual_seed(4)
    linear = layer(generator)
    x = torch.randn(3, 32, generator=generator)
    with caplog.at_level(logging.WARNING, logger="specdec.runtime.kernels"):
        y = linear(x)
    reference = torch.ops.quantized.linear_dynamic(x, linear._packed, int8._reduce_range())
    assert float((y - reference).norm() / reference.norm()) < kernels.CHECK_TOLERANCE
    assert registry._CHOICE[("int8-dynamic", 64, 32, 3)] in ("quick", "fbgemm-int8")
    # Chosen, then failing: the layer's own kernel takes over for good.
    key = ("int8-dynamic", 64, 32, 2)
    registry._CHOICE[key] = "flaky"
    two = torch.randn(2, 32, generator=generator)
    assert torch.equal(linear(two), torch.ops.quantized.linear_dynamic(two, linear._packed, int8._reduce_range()))
    assert registry._CHOICE[key] == "fbgemm-int8" and "flaky failed" in caplog.text


def per_row(name: str, delay_s: float = 0.0) -> kernels.Backend:
    """int8 activations scaled per row, as zentorch's: each row's output its own, whatever the call."""
    def run(state, x):
        time.sleep(delay_s)
        codes, scales = state
        x = x.float()
        step = x.abs().amax(1, keepdim=True).clamp(min=1e-12) / 127
        return (torch.round(x / step) @ codes.float().t()) * step * scales
    return kernels.Backend(name, "int8-channel", "torch", lambda c, s: (c, s), run, per_row=True)


def test_a_weight_only_layer_takes_int8_activations_only_where_asked_and_only_per_row(registry):
    registry.register(exact("per-call"))           # not per row: never offered to such a layer
    registry.register(per_row("rowwise"))
    generator = torch.Generator().manual_seed(5)
    weight = torch.randn(64, 32, generator=generator)
    plain, head = int8.Int8WeightOnlyLinear(weight), int8.Int8WeightOnlyLinear(weight, int8_activations=True)
    x = torch.randn(3, 32, generator=generator)
    plain(x), head(x)
    assert plain._accelerated() == []
    assert [b.name for b, _ in head._accelerated()] == ["rowwise"]


def test_a_per_layer_choice_serves_every_row_count_so_verification_matches_decoding(registry):
    # The per-row kernel is the faster one at one row and the slower one at many:
    # a choice per row bucket would give a 5-row verification other logits than
    # five 1-row decode steps. One choice per layer, made on its first call, does not.
    calls = []

    def timed(rows_slow: int):
        def run(state, x):
            calls.append(x.shape[0])
            time.sleep(0.04 if x.shape[0] >= rows_slow else 0)
            codes, scales = state
            step = x.float().abs().amax(1, keepdim=True).clamp(min=1e-12) / 127
            return (torch.round(x.float() / step) @ codes.float().t()) * step * scales
        return run
    registry.register(kernels.Backend("rowwise", "int8-channel", "torch", lambda c, s: (c, s), timed(4),
                                      per_row=True))
    generator = torch.Generator().manual_seed(6)
    head = int8.Int8WeightOnlyLinear(torch.randn(64, 32, generator=generator), int8_activations=True)
    own = head._weight_only

    def slow_own(flat):   # torch's weight-only kernel, made the slower at one row and the quicker at five
        time.sleep(0.02)
        return own(flat)
    head._weight_only = slow_own
    x = torch.randn(5, 32, generator=generator)
    one_at_a_time = torch.cat([head(x[i:i + 1]) for i in range(5)])   # decided here, at one row
    assert registry._CHOICE[("int8-wo", 64, 32, 0)] == "rowwise"
    assert any("int8-wo 64 32 every call: rowwise" == line for line in registry.choices())
    assert torch.equal(head(x), one_at_a_time)   # 5 rows, where it is slow: still the same kernel, the same rows
