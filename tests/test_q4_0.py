"""specdec.runtime.quant.q4_0: a draft's weights rounded to Q4_0 for llama.cpp's kernels. Each
Linear holds gguf's own Q4_0 blocks of its weight and computes their values; the head may be cut
to some ids (-inf elsewhere); where llama-cpp-python installs, the model's decode and verify
calls run as one ggml graph over those blocks, a verification's rows its decode steps bit for bit."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from specdec.rpc.errors import FailedPrecondition
from specdec.runtime import kernels
from specdec.runtime.models import load_model
from specdec.runtime.quant import quantizations
from specdec.runtime.quant.base import QuantizeContext
from specdec.runtime.quant.int4 import Int4Linear
from specdec.runtime.quant.int8 import Int8RestrictedHead, Int8WeightOnlyLinear
from specdec.runtime.quant.q4_0 import q4_0_codes, q4_0_linear
from specdec.weights import tiny

Q4_0 = GGMLQuantizationType.Q4_0


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


@pytest.mark.parametrize("rows, kind", [(48, Int4Linear), (40, Int8WeightOnlyLinear)])
def test_a_layer_holds_ggufs_q4_0_blocks_of_its_weight_and_computes_their_values(rows, kind):
    generator = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(rows, 96, generator=generator), torch.randn(rows, generator=generator)
    layer = q4_0_linear(weight, bias)
    # torch packs int4 rows in 16s: other row counts (a head cut to N ids and the special ones) run int8.
    assert type(layer) is kind and layer.ggml_type == int(Q4_0)
    assert torch.equal(layer.gguf_blocks, torch.from_numpy(quantize(weight.numpy(), Q4_0)))
    rounded = torch.from_numpy(dequantize(layer.gguf_blocks.numpy(), Q4_0).reshape(rows, 96))
    x = torch.randn(3, 96, generator=generator)
    with torch.no_grad():
        assert relative_error(layer(x), x @ rounded.T + bias) < 0.01     # the blocks' values
        assert relative_error(layer(x), x @ weight.T + bias) < 0.15      # 4 bits of the weight
        assert layer(x).dtype == torch.float32


def test_an_int4_layer_takes_the_q4_0_codes_as_they_are():
    weight = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    blocks = quantize(weight.numpy(), Q4_0)
    codes, d = q4_0_codes(blocks, 32, 64)
    assert codes.dtype == np.uint8 and codes.max() <= 15 and d.shape == (32, 2)
    values = (codes.astype(np.float32) - 8) * np.repeat(d, 32, axis=1)
    assert np.array_equal(values, dequantize(blocks, Q4_0).reshape(32, 64))   # exact: no second rounding


def test_the_draft_in_q4_0_its_head_cut_to_some_ids():
    full = load_model("tiny-draft", quantize="q4_0")
    cut = load_model("tiny-draft", quantize="q4_0", head_vocab=100)
    assert full.dtype == "fp32+q4_0"
    layers = [m for name, m in full.model.named_modules() if name.startswith("model.layers.")
              and isinstance(m, Int4Linear)]
    assert len(layers) == 7 * tiny.DRAFT_LAYERS and all(m.ggml_type == int(Q4_0) for m in layers)
    head = cut.model.lm_head
    assert isinstance(head, Int8RestrictedHead) and head.head.ggml_type == int(Q4_0)
    ids = torch.tensor([[5, 17, 99, 3, 250, 41]])
    with torch.no_grad():
        logits = cut.model(ids).logits[0]
    dropped = torch.ones(logits.shape[-1], dtype=torch.bool)
    dropped[head.keep_ids] = False
    assert head.keep_ids.numel() >= 100 and torch.isinf(logits[:, dropped]).all()
    assert torch.isfinite(logits[:, head.keep_ids]).all()


def test_q4_0_is_refused_off_the_cpu_with_a_reason():
    model, _ = tiny.build("tiny-draft")
    with pytest.raises(FailedPrecondition, match="q4_0 runs ggml's CPU kernels"):
        quantizations()["q4_0"].apply(model, QuantizeContext("tiny-draft", torch.device("cuda")))


@pytest.mark.parametrize("layout", ["ggml-graph", "ggml-graph-repacked"])
def test_on_the_ggml_graph_a_verification_is_its_decode_steps(monkeypatch, layout, kernel_state):
    pytest.importorskip("llama_cpp", reason="the ggml graph comes with llama-cpp-python: pip install '.[llama-cpp]'",
                        exc_type=ImportError)
    from specdec.runtime import ggml, ggml_forward
    if layout == "ggml-graph-repacked" and not ggml.repack_usable(ggml.Q4_0):
        pytest.skip("ggml's repacked Q4_0 kernels do not run on this CPU (the services then keep the plain blocks)")
    kernel_state.choices.update({(*ggml_forward.KEY, 0): layout})
    loaded = load_model("tiny-draft", quantize="q4_0", head_vocab=100)
    forward, reference = loaded.lean, load_model("tiny-draft", quantize="q4_0", head_vocab=100).lean
    graph = forward._graph()
    assert graph is not None and (graph.repacked > 0) == (layout == "ggml-graph-repacked")
    ids = torch.tensor([5, 17, 99, 3, 250, 41, 8, 77, 120, 64])
    steps, verify, own = forward.new_cache(), forward.new_cache(), reference.new_cache()
    for cache in (steps, verify):
        forward(ids[:4], cache, 0)
    one = torch.cat([forward(t[None], steps, 1) for t in ids[4:]])
    rows = forward(ids[4:], verify, 6)
    assert torch.equal(rows, one)
    kept = loaded.model.lm_head.keep_ids
    assert torch.isinf(rows).sum() == rows.shape[0] * (rows.shape[1] - kept.numel())
    kernel_state.choices.update({(*ggml_forward.KEY, 0): "torch"})
    with torch.no_grad():
        want = reference(ids, own, 6)
    assert relative_error(rows[:, kept], want[:, kept]) < 0.05


def test_the_default_pairs_q4_0_draft_is_int8_where_llama_cpp_is_missing_or_on_a_gpu(monkeypatch):
    import importlib.util

    from specdec.weights.pairs import DEFAULT_PAIR, PAIRS
    from specdec_tools.launcher import StackOptions
    pair = PAIRS[DEFAULT_PAIR]
    assert pair.draft_quantize == "q4_0"
    real_find_spec = importlib.util.find_spec
    for installed in (True, False):
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, *a: (real_find_spec("json") if installed else None) if name == "llama_cpp"
                            else real_find_spec(name, *a))
        assert StackOptions.for_pair(pair).draft_quantize == ("q4_0" if installed else "int8")
        assert StackOptions.for_pair(pair, device="cuda").draft_quantize == "int8"
        # INT8 on a GPU computes in bf16 (quant.int8_device); on the CPU it runs the pair's fp32.
        assert StackOptions.for_pair(pair, device="cuda").draft_dtype == "bf16"
        assert StackOptions.for_pair(pair, draft_quantize="int8").draft_dtype == pair.draft_dtype == "fp32"
        assert StackOptions.for_pair(pair, draft_quantize="q4_0").draft_quantize == "q4_0"   # asked for: kept
