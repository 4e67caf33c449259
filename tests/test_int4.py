"""specdec.runtime.quant.int4: Q4_K blocks carried over to int4 group-32 without a second rounding of the codes."""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from specdec.runtime.quant.int4 import Int4Linear, q4k_codes
from specdec.runtime.quant.int8 import Int8WeightOnlyLinear


def random_q4k(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Valid Q4_K bytes: random codes, scales and mins under sane fp16 d and dmin."""
    rng = np.random.default_rng(seed)
    n = rows * cols // 256
    blocks = rng.integers(0, 256, size=(n, 144), dtype=np.uint8)
    blocks[:, 0:2] = rng.uniform(1e-4, 2e-3, n).astype(np.float16).view(np.uint8).reshape(n, 2)
    blocks[:, 2:4] = rng.uniform(1e-4, 2e-3, n).astype(np.float16).view(np.uint8).reshape(n, 2)
    return blocks.reshape(-1)


def test_codes_scales_and_mins_rebuild_the_gguf_weights_exactly():
    rows, cols = 8, 512
    raw = random_q4k(rows, cols)
    codes, scale, minimum = q4k_codes(raw, rows, cols)
    assert codes.min() >= 0 and codes.max() <= 15 and codes.max() > 7
    rebuilt = codes.astype(np.float32) * np.repeat(scale, 32, axis=1) - np.repeat(minimum, 32, axis=1)
    reference = dequantize(raw, GGMLQuantizationType.Q4_K).reshape(rows, cols)
    np.testing.assert_array_equal(rebuilt, reference)


def test_the_int4_kernel_applies_the_codes_unchanged_and_only_rounds_scales():
    rows, cols = 64, 512
    raw = random_q4k(rows, cols, seed=1)
    layer = Int4Linear.from_q4k(raw, rows, cols)
    reference = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q4_K).reshape(rows, cols).copy())
    applied = layer.dequantized()
    # The codes are the GGUF's: the kernel's weight is affine in them per group, with
    # scale and zero the bf16 roundings of d*sc and 8*scale - dmin*m.
    codes, scale, minimum = (torch.from_numpy(a) for a in q4k_codes(raw, rows, cols))
    scale_bf16 = scale.to(torch.bfloat16).float()
    zero_bf16 = (8 * scale_bf16 - minimum).to(torch.bfloat16).float()
    expected = (codes.float() - 8) * scale_bf16.repeat_interleave(32, 1) + zero_bf16.repeat_interleave(32, 1)
    bf16 = 2.0 ** -8  # read out through the kernel, the weight is rounded to bf16 once more
    assert torch.allclose(applied, expected, atol=1e-6, rtol=bf16)
    # ... which is the GGUF weight within bf16 roundings, far under one code step (a
    # re-quantization would be off by up to half a step).
    step = scale.repeat_interleave(32, 1)
    off = (applied - reference).abs() - 2 * bf16 * reference.abs()
    assert (off <= step / 16).all() and off.mean() < (step / 64).mean()
    x = torch.randn(5, cols)
    # bf16 activations and output: off by a few bf16 roundings of the terms' magnitudes.
    assert ((layer(x) - x @ applied.t()).abs() <= 4 * bf16 * (x.abs() @ applied.abs().t())).all()


def write_gguf(path, tensors: dict) -> None:
    from gguf import GGUFWriter
    writer = GGUFWriter(str(path), "llama")
    for name, (raw, qtype, (rows, _)) in tensors.items():  # as bytes: [rows, bytes per row]
        writer.add_tensor(name, raw.reshape(rows, -1), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_q4k_linears_go_int4_others_int8_each_checked_first(tmp_path):
    from gguf.quants import quantize
    from specdec.runtime.quant.int4 import quantize_from_gguf

    torch.manual_seed(0)
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    layer = torch.nn.Module()
    layer.mlp = torch.nn.Module()
    layer.mlp.up_proj, layer.mlp.down_proj = torch.nn.Linear(256, 64), torch.nn.Linear(64, 256, bias=False)
    layer.self_attn = torch.nn.Module()
    layer.self_attn.q_proj = torch.nn.Linear(256, 256, bias=False)
    model.model.layers = torch.nn.ModuleList([layer])
    model.lm_head = torch.nn.Linear(64, 96, bias=False)
    up, q = random_q4k(64, 256, seed=2), random_q4k(256, 256, seed=3)
    head = quantize(np.random.default_rng(5).standard_normal((96, 64)).astype(np.float32),
                    GGMLQuantizationType.Q8_0)
    down = quantize(np.random.default_rng(4).standard_normal((256, 64)).astype(np.float32),
                    GGMLQuantizationType.Q8_0)
    down_weight = torch.from_numpy(dequantize(down, GGMLQuantizationType.Q8_0).reshape(256, 64))
    with torch.no_grad():  # the model holds what a loader made of the GGUF; q_proj as if permuted
        layer.mlp.up_proj.weight.copy_(torch.from_numpy(dequantize(up, GGMLQuantizationType.Q4_K).reshape(64, 256)))
        layer.mlp.down_proj.weight.copy_(down_weight)
        model.lm_head.weight.copy_(torch.from_numpy(dequantize(head, GGMLQuantizationType.Q8_0).reshape(96, 64)))
        layer.self_attn.q_proj.weight.copy_(torch.from_numpy(
            dequantize(q, GGMLQuantizationType.Q4_K).reshape(256, 256)[torch.randperm(256)].copy()))
    path = tmp_path / "model.gguf"
    write_gguf(path, {"blk.0.ffn_up.weight": (up, GGMLQuantizationType.Q4_K, (64, 256)),
                      "blk.0.ffn_down.weight": (down.reshape(-1), GGMLQuantizationType.Q8_0, (256, 64)),
                      "blk.0.attn_q.weight": (q, GGMLQuantizationType.Q4_K, (256, 256)),
                      "output.weight": (head.reshape(-1), GGMLQuantizationType.Q8_0, (96, 64))})
    x = torch.randn(3, 256)
    before = layer.mlp.up_proj(x).detach()
    report = quantize_from_gguf(model, str(path))
    assert report == {"int4": 1, "int8": 2, "mismatched": 1}
    assert isinstance(layer.mlp.up_proj, Int4Linear) and layer.mlp.up_proj.bias is not None
    assert layer.mlp.up_proj.int8_activations   # its input is a norm's output: int8 activations offered
    assert isinstance(layer.mlp.down_proj, Int8WeightOnlyLinear)
    # The LM head takes int8 activations (its input is the final norm's output) ...
    assert isinstance(model.lm_head, Int8WeightOnlyLinear) and model.lm_head.int8_activations
    # A down projection's input carries outlier channels: only kernels keeping ~14 bits of a row.
    assert layer.mlp.down_proj.int8_activations and layer.mlp.down_proj.activation_bits == 14
    assert isinstance(layer.self_attn.q_proj, torch.nn.Linear)  # mismatched: left as it was
    after = layer.mlp.up_proj(x)
    assert ((after - before).abs() <= 0.02 * (x.abs() @ layer.mlp.up_proj.dequantized().abs().t()) + 0.02).all()
    h = torch.randn(3, 64)
    assert torch.allclose(layer.mlp.down_proj(h), h @ down_weight.t(), rtol=0.03, atol=0.03 * h.abs().max() * 8)


def test_concat_computes_the_parts_side_by_side_and_the_parts_still_work(kernel_state):

    parts = [Int4Linear.from_q4k(random_q4k(rows, 256, seed=rows), rows, 256, torch.randn(rows))
             for rows in (64, 128, 32)]
    assert not Int4Linear.concatenable([parts[2], parts[0]])  # a partial 64-row block only last
    x = torch.randn(5, 256)
    # Each layer shape chooses its kernel by timing on its first call, so a fused layer and
    # its parts could run different kernels, whose bits differ: each kernel this machine
    # offers the layers is pinned for all of them in turn, and compared under it.
    offered = ["torch-int4", *(b.name for b, _ in parts[0]._accelerated()
                               if all(b.name in [o.name for o, _ in p._accelerated()] for p in parts[1:]))]

    def pinned(name: str, layers) -> None:
        kernel_state.choices.clear()
        kernel_state.choices.update({("int4", layer.out_features, 256, 0): name for layer in layers})

    separate = {}
    for name in offered:
        pinned(name, parts)
        separate[name] = [p(x) for p in parts]
    fused = Int4Linear.concat(parts)
    assert all(p.packed.untyped_storage().data_ptr() == fused.packed.untyped_storage().data_ptr() for p in parts)
    for name in offered:
        pinned(name, [fused, *parts])
        assert torch.equal(fused(x), torch.cat(separate[name], dim=-1)), name
        assert all(torch.equal(p(x), s) for p, s in zip(parts, separate[name])), name  # now views into fused
        assert set(kernel_state.choices.values()) == {name}   # none fell back to another kernel


def test_int4_needs_a_gguf_source_and_says_so():
    import pytest
    from specdec.rpc.errors import InvalidArgument
    from specdec.runtime.models import load_model
    with pytest.raises(InvalidArgument, match="builds its weights from a GGUF's Q4_K blocks"):
        load_model("tiny-target", quantize="int4")
    with pytest.raises(InvalidArgument, match="quantize must be one of none, int4, int8"):
        load_model("tiny-target", quantize="int3")


def test_a_gpu_stack_keeps_the_pairs_dtype_instead_of_cpu_int4():
    from specdec.weights.pairs import PAIRS
    from specdec_tools.launcher import StackOptions
    assert StackOptions.for_pair(PAIRS["qwen-coder"]).target_quantize == "int4"
    assert StackOptions.for_pair(PAIRS["qwen-coder"], device="cuda").target_quantize == "none"
    assert StackOptions.for_pair(PAIRS["qwen-coder"], device="cuda", target_quantize="int8").target_quantize == "int8"


def test_int4_on_cuda_is_torchaos_and_says_how_to_get_it(monkeypatch):
    import sys
    import pytest
    from specdec.rpc.errors import FailedPrecondition
    from specdec.runtime.quant.int4 import quantize_cuda
    for name in ("torchao", "torchao.quantization"):
        monkeypatch.setitem(sys.modules, name, None)  # as where it is not installed
    with pytest.raises(FailedPrecondition, match="pip install torchao"):
        quantize_cuda(torch.nn.Linear(64, 64))


def test_the_codes_and_the_dense_weight_read_back_out_of_the_kernels_packing():
    # Whole 64-row blocks, and a last partial block of each size the packing allows.
    for rows in (64, 80, 96, 112, 192):
        raw = random_q4k(rows, 256, seed=rows)
        layer = Int4Linear.from_q4k(raw, rows, 256)
        codes, _, _ = q4k_codes(raw, rows, 256)
        assert torch.equal(layer.codes(), torch.from_numpy(codes).to(torch.uint8)), rows
        dense = layer.dense_weight(torch.bfloat16)
        assert dense.dtype == torch.bfloat16 and dense.shape == (rows, 256)
        # The weight the kernel applies (read out through it), within a bf16 rounding.
        assert torch.allclose(dense.float(), layer.dequantized(), rtol=2.0 ** -7, atol=1e-6), rows
    # Parts of a fused layer read their own rows out of the shared buffers.
    parts = [Int4Linear.from_q4k(random_q4k(rows, 256, seed=rows), rows, 256) for rows in (64, 128, 32)]
    before = [p.dense_weight() for p in parts]
    fused = Int4Linear.concat(parts)
    assert all(torch.equal(p.dense_weight(), b) for p, b in zip(parts, before))
    assert torch.equal(fused.dense_weight(), torch.cat(before))


def test_a_quantization_is_one_module_and_a_registration():
    """The loader and the lean forward know quantizations only through the registry."""
    import torch
    from specdec.runtime.quant import METHODS, quantizations
    from specdec.runtime.quant.base import FUSABLE, fuse
    QUANTIZATIONS = quantizations()
    assert set(QUANTIZATIONS) == set(METHODS)  # each module registered itself under its name
    from specdec.runtime.quant.int4 import Int4Linear
    assert {"int4", "int8", "q4_0"} <= set(QUANTIZATIONS)   # the built-in ones; a new one needs no line here
    assert QUANTIZATIONS["int4"].needs_gguf and QUANTIZATIONS["int8"].uses_head_vocab
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert QUANTIZATIONS["int4"].dtype_label("bf16", cpu) == "bf16+int4"
    # INT8 runs fp32 activations on the CPU, the model's dtype off it (quant.int8_device).
    assert (QUANTIZATIONS["int8"].dtype_label("bf16", cpu), QUANTIZATIONS["int8"].dtype_label("bf16", cuda)) == \
        ("fp32+int8", "bf16+int8")
    dense = [torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)]
    assert fuse(dense) is None  # no registered kind fuses bf16 Linear layers: the lean forward runs them apart
    assert Int4Linear in FUSABLE  # int4 layers fuse q/k/v and gate/up


def test_gate_and_up_offer_int8_activations_checked_per_layer_and_a_verification_is_its_decode_steps(monkeypatch, kernel_state):
    from specdec.runtime import kernels

    # the GGUF-block kernels: tests/test_ggml.py
    monkeypatch.setattr(kernels, "BACKENDS", [b for b in kernels.BACKENDS if b.name != "ggml"])
    parts = [Int4Linear.from_q4k(random_q4k(128, 256, seed=s), 128, 256, int8_activations=True) for s in (7, 8)]
    plain = Int4Linear.from_q4k(random_q4k(128, 256, seed=9), 128, 256)
    fused = Int4Linear.concat(parts)
    assert fused.int8_activations and not plain.int8_activations
    assert plain._accelerated() == []
    x = torch.randn(6, 256).bfloat16()
    assert torch.equal(plain(x), plain._int4(x))   # not offered: torch's int4 kernel alone
    offered = [b.name for b, _ in fused._accelerated()]
    if "avx2" in kernels.cpu_flags():
        assert "fbgemm-int8-row" in offered      # each checked against the int4 kernel on this layer
    rows = fused(x)
    # Whichever kernel the first call chose serves every call: 6 rows at once give what
    # 6 one-row calls give, bit for bit, so a verification picks the decode step's tokens.
    assert torch.equal(rows, torch.cat([fused(x[r:r + 1]) for r in range(6)]))
    exact = x.float() @ fused.dense_weight(torch.float32).t()
    assert ((rows.float() - exact).norm() / exact.norm()) < 0.03
    # The int8 copy is this machine's: the model cache never holds it.
    state = fused.__getstate__()
    assert "_accel" in fused.__dict__ and "_accel" not in state
