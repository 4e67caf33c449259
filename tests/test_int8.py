"""INT8 building blocks against their fp32 originals, and the restricted head's
promise: ids outside it get probability zero, the rest keep their logits."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from specdec.runtime import kernels
from specdec.runtime.quant import int8
from specdec.runtime.quant.int8 import Int8Linear
from specdec.runtime.models import load_model


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm()).item()


@pytest.fixture
def generator() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def test_int8_linear_is_close_to_fp32_and_keeps_shape_and_dtype(generator):
    linear = nn.Linear(96, 200, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(200, 96, generator=generator) * 0.05)
    x = torch.randn(2, 3, 96, generator=generator)
    quantized = int8.Int8Linear.from_linear(linear)
    out = quantized(x)
    assert out.shape == (2, 3, 200) and out.dtype == torch.float32
    assert relative_error(out, linear(x)) < 0.02


def test_per_channel_scales_keep_small_rows_that_a_per_tensor_scale_would_flatten(generator):
    weight = torch.randn(64, 128, generator=generator) * 0.01
    weight[0] *= 300  # one large row sets a per-tensor scale
    x = torch.randn(4, 128, generator=generator)
    small_rows = slice(1, None)
    out = int8.Int8Linear(weight)(x)[:, small_rows]
    expected = (x @ weight.T)[:, small_rows]
    per_tensor = torch.round(weight / (weight.abs().max() / 127)) * (weight.abs().max() / 127)
    assert relative_error(out, expected) < 0.02
    assert relative_error((x @ per_tensor.T)[:, small_rows], expected) > 0.2


def test_weight_only_int8_holds_activation_outliers(generator, registry):
    # `registry`: no accelerated backend, so Int8Linear runs fbgemm's dynamic GEMM, 8 bits an
    # activation per call. Where timing picked the 14-bit per-row kernel (fbgemm-int8-row) for
    # the call, the outlier kept its other activations too, and this failed in one suite of two.
    weight = torch.randn(48, 256, generator=generator) * 0.05
    x = torch.randn(1, 256, generator=generator)
    x[0, 7] = 200.0  # a massive activation, as in Qwen's MLP down projections
    weight_only = int8.Int8WeightOnlyLinear(weight)
    expected = x @ weight_only.dense_weight().float().T   # the same int8 weights: only activations differ
    kept = relative_error(weight_only(x), expected)
    assert kept < 0.01                                    # bf16 activations: the outlier and the rest
    # Quantized per call at 7 or 8 bits, the other activations round to a step of 200/127 or coarser.
    assert relative_error(int8.Int8Linear(weight)(x), expected) > 2 * kept


def test_gated_mlp_matches_the_original(tiny_target, generator):
    mlp = copy.deepcopy(tiny_target.model.model.layers[0].mlp).float()
    assert int8.Int8GatedMLP.matches(mlp)
    x = torch.randn(1, 5, mlp.gate_proj.in_features, generator=generator)
    assert relative_error(int8.Int8GatedMLP(mlp)(x), mlp(x)) < 0.03


def test_restricted_head_zeroes_the_other_ids_and_keeps_the_kept_logits(generator):
    weight = torch.randn(50, 16, generator=generator)
    keep = int8.head_keep_ids(50, 20, always=[45, 49, 99])
    assert keep.tolist() == [*range(20), 45, 49]
    head = int8.Int8RestrictedHead(weight, keep, 50)
    hidden = torch.randn(3, 16, generator=generator)
    logits = head(hidden)
    assert logits.shape == (3, 50)
    dropped = torch.ones(50, dtype=torch.bool)
    dropped[keep] = False
    assert torch.isinf(logits[:, dropped]).all() and (logits[:, dropped] < 0).all()
    assert relative_error(logits[:, keep], hidden @ weight[keep].T) < 0.02
    assert torch.softmax(logits, -1)[:, dropped].sum() == 0


def test_quantized_draft_model_agrees_with_its_fp32_self(tiny_draft):
    quantized = load_model("tiny-draft", quantize="int8")
    assert isinstance(quantized.model.get_output_embeddings(), int8.Int8Linear)
    assert not any(isinstance(m, nn.Linear) for m in quantized.model.modules())
    ids = torch.tensor([quantized.tokenizer.encode("the draft model proposes a few tokens and the target checks")])
    with torch.no_grad():
        reference = tiny_draft.model(ids).logits[0]
        logits = quantized.model(ids).logits[0]
    agreement = (reference.argmax(-1) == logits.argmax(-1)).float().mean().item()
    assert agreement >= 0.9, agreement


def test_head_vocab_restricts_what_the_draft_can_propose():
    quantized = load_model("tiny-draft", quantize="int8", head_vocab=100)
    head = quantized.model.get_output_embeddings()
    assert isinstance(head, int8.Int8RestrictedHead)
    special = set(quantized.tokenizer.all_special_ids)
    assert set(head.keep_ids.tolist()) == set(range(100)) | special
    ids = torch.tensor([quantized.tokenizer.encode("the target checks all of them in one forward pass")])
    with torch.no_grad():
        probs = torch.softmax(quantized.model(ids).logits[0], -1)
    outside = [i for i in range(probs.shape[-1]) if i not in set(head.keep_ids.tolist())]
    assert probs[:, outside].sum().item() == 0.0


def test_a_ranked_head_keeps_the_most_frequent_ids_then_the_lowest(monkeypatch, tmp_path):
    from specdec.weights import vocab_rank
    ranked = vocab_rank.rank({7: 5, 3: 5, 40: 2}, {9: 4, 7: 1})
    assert ranked == [7, 3, 40, 9]   # by output count, then prompt count (7 is in a prompt), then id
    assert vocab_rank.head_ids(50, 3, always=[49], ranking=ranked) == [3, 7, 40, 49]
    # A ranking that runs out goes on by id; ids past the vocabulary are never kept.
    assert vocab_rank.head_ids(50, 6, always=[], ranking=[44, 99, 2]) == [0, 1, 2, 3, 4, 44]
    # Through the loader: the tokenizer's ranking is found by its fingerprint and cuts the head.
    monkeypatch.setattr(vocab_rank, "DIR", tmp_path)
    plain = load_model("tiny-draft", quantize="int8", head_vocab=10)
    favourite = list(range(400, 410))
    vocab_rank.save(plain.fingerprint, favourite)
    ranked_model = load_model("tiny-draft", quantize="int8", head_vocab=10)
    kept = set(ranked_model.model.get_output_embeddings().keep_ids.tolist())
    tok = ranked_model.tokenizer
    special = {*tok.all_special_ids, *tok.added_tokens_decoder, *ranked_model.eos_token_ids}
    assert set(favourite) <= kept and kept - set(favourite) <= special and set(plain.model.get_output_embeddings().keep_ids.tolist()) != kept


@pytest.fixture
def fbgemm_only(monkeypatch):
    """torch's own int8 kernel alone: where an accelerated backend installs, which kernel a shape
    runs is timed on this machine, and kernels with other activation scales differ by roundings."""
    monkeypatch.setattr(kernels, "BACKENDS", [])


def test_qkv_fuse_into_one_int8_gemm_and_each_output_is_its_parts(generator, fbgemm_only):
    # One activation quantization and one GEMM for q, k and v (fbgemm's activation scale is
    # the input's, which all three share), from the parts' own codes: nothing is re-rounded.
    parts = [int8.Int8Linear(torch.randn(n, 64, generator=generator) * 0.05, torch.randn(n, generator=generator))
             for n in (64, 16, 16)]
    x = torch.randn(5, 64, generator=generator)
    expected = torch.cat([p(x) for p in parts], dim=-1)
    assert int8.Int8Linear.concatenable(parts)
    fused = int8.Int8Linear.concat(parts)
    assert (fused.in_features, fused.out_features) == (64, 96)
    assert torch.allclose(fused(x), expected, rtol=0, atol=1e-6)
    # The parts hold no weight of their own now: each is its slice of the fused output.
    assert all("_packed" not in p.__dict__ for p in parts)
    assert torch.allclose(torch.cat([p(x) for p in parts], dim=-1), expected, rtol=0, atol=1e-6)
    # A second lean forward over the same model finds the fused layer, not a copy of it.
    assert int8.Int8Linear.concat(parts) is fused
    assert not int8.Int8Linear.concatenable(parts[:2])   # a part of a fused layer alone: no new fusion


def test_the_int8_draft_runs_its_qkv_fused_in_the_lean_forward(monkeypatch, fbgemm_only):
    loaded = load_model("tiny-draft", quantize="int8")
    assert all(isinstance(layer.qkv, int8.Int8Linear) for layer in loaded.lean.layers)
    from specdec.runtime import decoder_layer
    monkeypatch.setattr(decoder_layer, "fuse", lambda layers: None)   # the same draft, built again with nothing fused
    separate = load_model("tiny-draft", quantize="int8")
    assert all(layer.qkv is None for layer in separate.lean.layers)
    ids = torch.arange(3, 20)
    got = loaded.lean(ids, loaded.lean.new_cache(), keep_last=3)
    want = separate.lean(ids, separate.lean.new_cache(), keep_last=3)
    assert torch.allclose(got, want, rtol=0, atol=1e-4)


def test_each_row_comes_out_as_it_would_alone_so_a_seeded_draft_ignores_its_batch(monkeypatch, kernel_state):
    # fbgemm's dynamic GEMM scales its activations on the whole call's range: eight
    # sessions' rows in one call would each depend on the other seven. The layer keeps
    # one kernel for every call that gives each row its bits alone (--batch-invariant's
    # promise; a gathered batch of several sessions may choose otherwise).
    torch.manual_seed(0)
    layer = Int8Linear(torch.randn(48, 64), torch.randn(48))
    x = torch.randn(8, 64) * torch.linspace(0.1, 10, 8)[:, None]   # rows of very different ranges
    alone = torch.cat([layer(x[i:i + 1]) for i in range(8)])
    together = layer(x)
    assert torch.equal(together, alone)
    per_call = torch.ops.quantized.linear_dynamic(x, layer._packed, kernels.reduce_range())
    assert not torch.equal(per_call, alone)     # what a single fbgemm call gives them
