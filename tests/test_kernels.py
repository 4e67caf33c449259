"""specdec.runtime.kernels: accelerated backends behind one interface, skipped
where they do not install or fail their check, chosen per shape and row bucket
by timing; a quantized layer gives the same result whichever runs."""
from __future__ import annotations

import io
import logging
import pickle
import platform
import time

import pytest
import torch

from specdec.runtime import kernel_choices, kernels
from specdec.runtime.quant import int8


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


def by_row(linear: int8.Int8Linear, x: torch.Tensor) -> torch.Tensor:
    """The layer's own kernel: fbgemm's dynamic GEMM, each row alone."""
    return torch.cat([torch.ops.quantized.linear_dynamic(x[i:i + 1], linear._packed, kernels.reduce_range())
                      for i in range(x.shape[0])])


def test_a_backend_that_does_not_install_is_skipped_with_a_line_and_the_layer_runs_as_before(registry, caplog):
    registry.register(kernels.Backend("missing", "int8-channel", "specdec_no_such_package", dequantized,
                                      lambda w, x: x))
    generator = torch.Generator().manual_seed(0)
    with caplog.at_level(logging.INFO, logger="specdec.runtime.kernels"):
        linear = layer(generator)
        x = torch.randn(3, 32, generator=generator)
        y = linear(x)
    assert "kernel backend missing skipped" in caplog.text and "specdec_no_such_package" in caplog.text
    assert linear._accelerated() == [] and kernel_choices.state().choices == {}
    assert torch.equal(y, by_row(linear, x))


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
    # Per row bucket: a batched forward of several sessions' rows (`kernel_choices.gathered`).
    registry.register(exact("slow", delay_s=0.02))
    registry.register(exact("quick"))
    generator = torch.Generator().manual_seed(2)
    linear = layer(generator)
    x = torch.randn(5, 32, generator=generator)
    with kernel_choices.gathered():
        y = linear(x)
    assert [b.name for b, _ in linear._accelerated()] == ["slow", "quick"]
    key = ("int8-dynamic", 64, 32, "gathered", kernel_choices.bucket(5))
    assert kernel_choices.state().choices[key] in ("quick", "fbgemm-int8")    # never the one that sleeps
    assert any("rows<=5" in line for line in kernel_choices.choices())
    # The same bucket again: no new timing, the same kernel (a chosen kernel is deterministic).
    started = time.perf_counter()
    with kernel_choices.gathered():
        again = linear(x)
    assert time.perf_counter() - started < 0.02 and torch.equal(again, y)
    # Every kernel gives the layer's result within int8 roundings (bias included).
    reference = torch.ops.quantized.linear_dynamic(x, linear._packed, kernels.reduce_range())
    assert float((y - reference).norm() / reference.norm()) < kernels.CHECK_TOLERANCE


def test_row_buckets_are_exact_to_eight_then_powers_of_two():
    assert [kernel_choices.bucket(r) for r in (1, 4, 5, 8, 9, 16, 17, 64, 65)] == [1, 4, 5, 8, 16, 16, 32, 64, 128]


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
    with caplog.at_level(logging.WARNING, logger="specdec.runtime.kernels"), kernel_choices.gathered():
        y = linear(x)
    reference = torch.ops.quantized.linear_dynamic(x, linear._packed, kernels.reduce_range())
    assert float((y - reference).norm() / reference.norm()) < kernels.CHECK_TOLERANCE
    assert kernel_choices.state().choices[("int8-dynamic", 64, 32, "gathered", 3)] in ("quick", "fbgemm-int8")
    # Chosen, then failing: the layer's own kernel takes over for good.
    key = ("int8-dynamic", 64, 32, "gathered", 2)
    kernel_choices.state().choices[key] = "flaky"
    two = torch.randn(2, 32, generator=generator)
    with caplog.at_level(logging.WARNING, logger="specdec.runtime.kernels"), kernel_choices.gathered():
        assert torch.equal(linear(two), by_row(linear, two))
    assert kernel_choices.state().choices[key] == "fbgemm-int8" and "flaky failed" in caplog.text


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
    assert kernel_choices.state().choices[("int8-wo", 64, 32, 0)] == "rowwise"
    assert any("int8-wo 64 32 every call: rowwise" == line for line in kernel_choices.choices())
    assert torch.equal(head(x), one_at_a_time)   # 5 rows, where it is slow: still the same kernel, the same rows


def quick_at_one_row_head(registry, seed: int) -> tuple[int8.Int8WeightOnlyLinear, torch.Generator]:
    """A head offered "rowwise", the quicker kernel at one row and the slower from 4 rows,
    against its own kernel, made the slower at one row; and the generator that made it."""
    def run(state, x):
        time.sleep(0.04 if x.shape[0] >= 4 else 0)
        codes, scales = state
        return x.float() @ (codes.float() * scales[:, None]).t()
    registry.register(kernels.Backend("rowwise", "int8-channel", "torch", lambda c, s: (c, s), run, per_row=True))
    generator = torch.Generator().manual_seed(seed)
    head = int8.Int8WeightOnlyLinear(torch.randn(64, 32, generator=generator), int8_activations=True)
    own = head._weight_only
    head._weight_only = lambda flat: time.sleep(0.02) or own(flat)
    return head, generator


def test_a_per_layer_choice_is_timed_on_one_row_whatever_rows_its_first_call_has(registry):
    # A warm-up's or a short prompt's few rows may come first: the choice is still a decode step's.
    head, generator = quick_at_one_row_head(registry, seed=8)
    head(torch.randn(5, 32, generator=generator))      # the first call: 5 rows
    assert kernel_choices.state().choices[("int8-wo", 64, 32, 0)] == "rowwise"


def test_a_backend_whose_cpu_features_are_missing_is_skipped_with_a_line_and_never_imported(registry, monkeypatch,
                                                                                             caplog):
    # A native library may end the process on a CPU without its instructions (zentorch's
    # int8 GEMM dies of SIGILL on an AVX2-only CPU): such a backend is not even imported.
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    registry.register(kernels.Backend("needs-vnni", "int8-channel", "specdec_import_would_fail_loudly", dequantized,
                                      lambda w, x: x, cpu_flags=("avx2", "avx512_vnni")))
    registry.register(exact("plain"))
    imported = []
    real_import = kernels.importlib.import_module
    monkeypatch.setattr(kernels.importlib, "import_module", lambda name: imported.append(name) or real_import(name))
    with caplog.at_level(logging.INFO, logger="specdec.runtime.kernels"):
        found = registry.usable("int8-channel")
    assert [b.name for b in found] == ["plain"]
    assert imported == ["torch"]
    assert "kernel backend needs-vnni skipped: this CPU lacks avx512_vnni" in caplog.text


def test_the_cpu_flags_are_read_from_the_cpu_and_zentorch_asks_for_vnni():
    flags = kernels.cpu_flags()
    assert isinstance(flags, frozenset)
    if platform.machine() == "x86_64":
        assert "fpu" in flags   # every x86 CPU lists it
    zentorch = [b for b in kernels.BACKENDS if b.module == "zentorch"]
    assert zentorch and all("avx512_vnni" in b.cpu_flags for b in zentorch)


def test_a_kernel_many_times_slower_than_the_fastest_is_timed_once_not_every_try(registry):
    # Timing is paid by the request that meets a new row bucket: a hopeless path (bf16
    # emulated on an AVX2 CPU, 4x the int8 kernel) is called once, a close one every try.
    calls = {"own": 0, "close": 0, "hopeless": 0}

    def kernel(name, delay_s):
        def call():
            calls[name] += 1
            time.sleep(delay_s)
            return torch.zeros(1)
        return call
    kernel_choices.pick(("k",), 5, {"own": kernel("own", 0.02), "close": kernel("close", 0.02),
                              "hopeless": kernel("hopeless", 0.02 * (kernel_choices.HOPELESS + 5))})
    assert calls == {"own": kernel_choices.TRIES, "close": kernel_choices.TRIES, "hopeless": 1}
    assert kernel_choices.state().choices[("k", 5)] in ("own", "close")


def test_a_per_layer_choice_made_on_a_prefill_chunk_is_timed_on_one_row_and_serves_every_call(registry):
    # A layer's first call may be a 200-token prompt's prefill chunk on the kernel path: the
    # kernel fastest at one row is chosen, and it serves every call after, 100 rows included
    # (decode rows of many sessions gathered with prefill chunks into one kernel call).
    head, generator = quick_at_one_row_head(registry, seed=10)
    x = torch.randn(100, 32, generator=generator)
    first = head._kernel(x.bfloat16())
    assert kernel_choices.state().choices == {("int8-wo", 64, 32, 0): "rowwise"}
    assert torch.equal(first, torch.cat([head._kernel(x[i:i + 1].bfloat16()) for i in range(100)]))
    assert kernel_choices.state().choices == {("int8-wo", 64, 32, 0): "rowwise"}


def test_a_backend_whose_selftest_fails_is_skipped_with_a_line(registry, caplog):
    def dies():   # what ggml's probe reports when its child process ended with SIGILL
        raise RuntimeError("a probe matmul in a child process ended with code -4")
    registry.register(kernels.Backend("crashes", "int8-channel", "torch", dequantized,
                                      lambda w, x: x @ w.t(), selftest=dies))
    with caplog.at_level(logging.INFO, logger="specdec.runtime.kernels"):
        assert kernels.usable("int8-channel") == []
        assert kernels.usable("int8-channel") == []   # said once, remembered
    assert caplog.text.count("kernel backend crashes skipped") == 1
    assert "ended with code -4" in caplog.text


def test_a_service_batching_many_sessions_times_the_choice_at_its_rows(registry, monkeypatch, kernel_state):
    # --kernel-rows 8: the kernel quickest at one row but slow at eight is not chosen,
    # though the first call is a decode step's one row.
    kernel_choices.choose_at(8)
    head, generator = quick_at_one_row_head(registry, seed=9)
    head(torch.randn(1, 32, generator=generator))
    assert kernel_choices.state().choices[("int8-wo", 64, 32, 0)] == "torch-int8-wo"
    with pytest.raises(ValueError, match="--kernel-rows must be at least 1"):
        kernel_choices.choose_at(0)


def test_a_kernel_restored_for_batches_of_several_sessions_only_is_made_after_serving(registry):
    # A start profile naming a backend for gathered buckets only: the layer's first call
    # does not make its weight; gathered calls run the layer's own kernel until
    # prepare_deferred has made it, then the backend.
    made = []

    def prepare(codes, scales):
        made.append(codes.shape)
        return codes.float() * scales[:, None]
    # Its arithmetic 1% off the layer's own (within the check), so which one ran shows.
    registry.register(kernels.Backend("rowwise", "int8-channel", "torch", prepare,
                                      lambda w, x: 1.01 * (x.float() @ w.t()), per_row=True))
    generator = torch.Generator().manual_seed(11)
    head = int8.Int8WeightOnlyLinear(torch.randn(64, 32, generator=generator), int8_activations=True)
    key = ("int8-wo", 64, 32)
    kernel_choices.restore_choices({(*key, 0): "torch-int8-wo", (*key, "gathered", 8): "rowwise"})
    x = torch.randn(8, 32, generator=generator)
    own = head._weight_only(x.bfloat16()).float()
    alone = head(x).float()
    assert made == [] and torch.equal(alone, own)          # a session alone: its own kernel, nothing made
    with kernel_choices.gathered():
        assert torch.equal(head(x).float(), own)           # not made yet: the layer's own kernel in its place
    assert kernel_choices.prepare_deferred(lambda fn: fn()) == 1 and made == [(64, 32)]
    assert kernel_choices.state().deferred == []
    with kernel_choices.gathered():
        served = head(x).float()
    assert 1.005 < (served / own).median() < 1.015          # now the backend's
    assert torch.equal(head(x).float(), alone)              # and a session alone still its own
