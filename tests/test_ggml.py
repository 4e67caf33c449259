"""specdec.runtime.ggml: llama.cpp's CPU matmuls over a GGUF tensor's own blocks,
where llama-cpp-python installs (`pip install ".[llama-cpp]"`): right against the
de-quantized tensor, each row computed alone, and offered to the int4 target's
layers through the kernel registry, where a verification's rows stay the decode
step's bit for bit."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from specdec.runtime.quant.int4 import Int4Linear
from specdec.runtime.quant.int8 import Int8WeightOnlyLinear
from tests.test_int4 import random_q4k

# Skipped where llama-cpp-python is missing, and where it is there but does not import (a build
# for another CPU or Python: ImportError, not ModuleNotFoundError), as the services skip the backend.
pytest.importorskip("llama_cpp", reason="the ggml kernels come with llama-cpp-python: pip install '.[llama-cpp]'",
                    exc_type=ImportError)
from specdec.runtime import ggml  # noqa: E402


def random_q6k(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Valid Q6_K bytes: random 6-bit codes and int8 sub-scales under a sane fp16 d (last 2 bytes)."""
    rng = np.random.default_rng(seed)
    n = rows * cols // 256
    blocks = rng.integers(0, 256, size=(n, 210), dtype=np.uint8)
    blocks[:, 208:210] = rng.uniform(1e-4, 1e-3, n).astype(np.float16).view(np.uint8).reshape(n, 2)
    return blocks.reshape(-1)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


@pytest.mark.parametrize("kind, make", [(GGMLQuantizationType.Q4_K, random_q4k),
                                        (GGMLQuantizationType.Q6_K, random_q6k)])
def test_a_matmul_over_the_blocks_is_the_gguf_tensors_product(kind, make):
    rows, cols = 96, 512
    raw = make(rows, cols, seed=3)
    weight = torch.from_numpy(dequantize(raw, kind).reshape(rows, cols))
    linear = ggml.GgmlLinear(torch.from_numpy(raw).view(rows, -1), int(kind), cols)
    x = torch.randn(3, cols, generator=torch.Generator().manual_seed(0))
    got = linear(x)
    assert got.shape == (3, rows) and got.dtype == torch.float32
    # Only the activations are rounded (8 bits per block of a row): the weight is the GGUF's.
    assert relative_error(got, x @ weight.t()) < 0.02


def test_each_row_comes_out_alone_in_calls_of_any_rows():
    rows, cols = 64, 256
    raw = random_q4k(rows, cols, seed=4)
    linear = ggml.GgmlLinear(torch.from_numpy(raw).view(rows, -1), int(GGMLQuantizationType.Q4_K), cols)
    x = torch.randn(11, cols, generator=torch.Generator().manual_seed(1))
    assert linear.rows_alone(x)
    one_at_a_time = torch.cat([linear(x[i:i + 1]) for i in range(11)])
    for count in (2, 5, 8, 11):   # past CHUNK_ROWS a call runs in chunks, and 8 rows is ggml's other path
        assert torch.equal(linear(x[:count]), one_at_a_time[:count])
    # A bf16 caller's rows go in and come out in bf16: the fp32 product, rounded once.
    half = x.bfloat16()
    got = linear(half, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, linear(half.float()).bfloat16())


def test_unaligned_blocks_are_copied_to_aligned_memory():
    rows, cols = 64, 256
    raw = torch.from_numpy(random_q4k(rows, cols, seed=5))
    shifted = torch.empty(raw.numel() + 1, dtype=torch.uint8)[1:].copy_(raw)   # an odd address
    linear = ggml.GgmlLinear(shifted.view(rows, -1), int(GGMLQuantizationType.Q4_K), cols)
    assert linear.blocks.data_ptr() % 64 == 0
    x = torch.randn(2, cols, generator=torch.Generator().manual_seed(2))
    aligned = ggml.GgmlLinear(raw.view(rows, -1), int(GGMLQuantizationType.Q4_K), cols)
    assert torch.equal(linear(x), aligned(x))


def test_the_int4_layers_offer_it_and_a_verification_is_its_decode_steps(monkeypatch, kernel_state):
    parts = [Int4Linear.from_q4k(random_q4k(128, 256, seed=s), 128, 256) for s in (7, 8)]
    fused = Int4Linear.concat(parts)                       # q/k/v or gate/up: their blocks side by side
    assert torch.equal(fused.gguf_blocks, torch.cat([p.gguf_blocks for p in parts]))
    assert "ggml" in [b.name for b, _ in fused._accelerated()]   # checked against the int4 kernel
    monkeypatch.setitem(kernel_state.choices, ("int4", 256, 256, 0), "ggml")
    x = torch.randn(6, 256, generator=torch.Generator().manual_seed(3)).bfloat16()
    rows = fused(x)
    assert torch.equal(rows, torch.cat([fused(x[r:r + 1]) for r in range(6)]))
    exact = x.float() @ fused.dense_weight(torch.float32).t()
    assert relative_error(rows, exact) < 0.03
    # The prepared kernel is this machine's: the model cache holds the blocks, not it.
    assert "_accel" not in fused.__getstate__()


def test_a_q6k_layer_kept_in_int8_offers_it_on_its_own_blocks(monkeypatch, kernel_state):
    raw = random_q6k(64, 256, seed=9)
    weight = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q6_K).reshape(64, 256))
    layer = Int8WeightOnlyLinear(weight, blocks=torch.from_numpy(raw), ggml_type=int(GGMLQuantizationType.Q6_K))
    assert [b.name for b, _ in layer._accelerated()] == ["ggml"]
    assert Int8WeightOnlyLinear(weight)._accelerated() == []      # no blocks: nothing to run them on
    monkeypatch.setitem(kernel_state.choices, ("int8-wo", 64, 256, 0), "ggml")
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(4))
    out = layer(x)
    assert torch.equal(out, torch.cat([layer(x[r:r + 1]) for r in range(5)]))
    assert relative_error(out, x @ weight.t()) < 0.02


def test_a_layer_whose_blocks_fail_the_check_keeps_torchs_kernel(monkeypatch, caplog, kernel_state):
    raw = random_q4k(64, 256, seed=10)
    layer = Int4Linear.from_q4k(raw, 64, 256)
    layer.gguf_blocks = torch.from_numpy(random_q4k(64, 256, seed=11)).view(64, -1)   # another tensor's blocks
    with caplog.at_level("WARNING", logger="specdec.runtime.kernels"):
        assert layer._accelerated() == []
    assert "ggml skipped for 64 x 256 layers: it failed its check" in caplog.text


def test_a_repacked_q4k_weight_gives_each_row_the_bits_of_a_one_row_call():
    if not ggml.repack_usable(ggml.Q4_K):
        pytest.skip("ggml's repacked Q4_K kernels do not run on this CPU (its probe said why in the log)")
    rows, cols = 64, 512
    blocks = torch.from_numpy(random_q4k(rows, cols, seed=3)).view(torch.uint8).reshape(rows, -1)
    x = torch.randn(ggml.REPACK_ROWS, cols, generator=torch.Generator().manual_seed(0))
    got = ggml.probe_repacked(blocks, ggml.Q4_K, x)
    one = torch.cat([ggml.probe_repacked(blocks, ggml.Q4_K, x[i:i + 1]) for i in range(x.shape[0])])
    assert torch.equal(got, one)
    want = x @ torch.from_numpy(dequantize(blocks.numpy().reshape(-1), GGMLQuantizationType.Q4_K)).reshape(rows, cols).T
    assert relative_error(got, want) < 0.02   # Q8_K activations against fp32
