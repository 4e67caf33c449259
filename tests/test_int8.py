"""INT8 building blocks against their fp32 originals, and the restricted head's
promise: ids outside it get probability zero, the rest keep their logits."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from specdec.runtime.quant import int8
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


def test_weight_only_int8_holds_activation_outliers(generator):
    weight = torch.randn(48, 256, generator=generator) * 0.05
    x = torch.randn(1, 256, generator=generator)
    x[0, 7] = 2000.0  # a massive activation, as in Qwen's MLP down projections
    expected = x @ weight.T
    assert relative_error(int8.Int8WeightOnlyLinear(weight)(x), expected) < 0.01
    assert relative_error(int8.Int8WeightOnlyLinear(weight)(x), expected) < relative_error(
        int8.Int8Linear(weight)(x), expected)


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
