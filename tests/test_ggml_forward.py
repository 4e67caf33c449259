"""specdec.runtime.ggml_forward: a model's decode and verify calls as one ggml graph over the
GGUF's blocks, where llama-cpp-python installs. A tiny random Qwen2 built from a GGUF in the
test: the graph computes the model (against its fp32 self), over the blocks as they are and
laid out for ggml's repacked kernels, a verification's rows are its decode steps bit for bit, a call's logits do not depend on what else shares the forward, and
a model it does not cover, a pinned choice, or a graph that fails its check keeps torch's forward."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from transformers import Qwen2Config, Qwen2ForCausalLM

from specdec.runtime import kernel_choices, lean
from specdec.runtime.quant.int4 import quantize_from_gguf
from tests.test_int4 import random_q4k, write_gguf

pytest.importorskip("llama_cpp", reason="the ggml kernels come with llama-cpp-python: pip install '.[llama-cpp]'",
                    exc_type=ImportError)
from specdec.runtime import ggml, ggml_forward  # noqa: E402

HIDDEN, INTER, VOCAB = 256, 512, 320
GGUF_NAMES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
              "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}


def tiny_qwen(tmp_path, layers: int = 2) -> tuple[Qwen2ForCausalLM, Qwen2ForCausalLM]:
    """(the model in int4 from its GGUF, the same weights de-quantized in fp32)."""
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False, use_sliding_window=False)
    model = Qwen2ForCausalLM(config).eval()
    tensors, seed = {}, 0
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            for module_name, linear in [*layer.self_attn.named_children(), *layer.mlp.named_children()]:
                if module_name not in GGUF_NAMES:
                    continue
                rows, cols = linear.weight.shape
                raw, seed = random_q4k(rows, cols, seed=seed), seed + 1
                linear.weight.copy_(torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q4_K).reshape(rows, cols)))
                if linear.bias is not None:
                    linear.bias.normal_(0, 0.5)
                tensors[f"blk.{i}.{GGUF_NAMES[module_name]}.weight"] = (raw, GGMLQuantizationType.Q4_K, (rows, cols))
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.uniform_(0.5, 1.5)
        head = quantize(np.random.default_rng(5).standard_normal((VOCAB, HIDDEN)).astype(np.float32),
                        GGMLQuantizationType.Q8_0)
        model.lm_head.weight.copy_(torch.from_numpy(dequantize(head, GGMLQuantizationType.Q8_0).reshape(VOCAB, HIDDEN)))
        tensors["output.weight"] = (head.reshape(-1), GGMLQuantizationType.Q8_0, (VOCAB, HIDDEN))
    reference = Qwen2ForCausalLM(config).eval()
    reference.load_state_dict(model.state_dict())
    path = tmp_path / "tiny-qwen.gguf"
    write_gguf(path, tensors)
    report = quantize_from_gguf(model, str(path))
    assert report == {"int4": 7 * layers, "int8": 1, "mismatched": 0}
    return model, reference


@pytest.fixture
def pinned(monkeypatch, kernel_state):

    def pin(name: str) -> None:
        kernel_state.choices[(*ggml_forward.KEY, 0)] = name
    return pin


def needs_layout(name: str) -> None:
    if name == "ggml-graph-repacked" and not ggml.repack_usable(ggml.Q4_K):
        pytest.skip("ggml's repacked Q4_K kernels do not run on this CPU (the services then keep the plain blocks)")


@pytest.mark.parametrize("name", ["ggml-graph", "ggml-graph-repacked"])
def test_the_graph_computes_the_model_and_a_verification_is_its_decode_steps(tmp_path, pinned, name):
    needs_layout(name)
    model, reference = tiny_qwen(tmp_path)
    pinned(name)
    forward = lean.LeanForward(model)
    ids = torch.tensor([5, 17, 99, 3, 250, 41, 8, 77, 120, 64, 2])
    prompt, drafts = ids[:5], ids[5:]
    steps, verify = forward.new_cache(), forward.new_cache()
    forward(prompt[:-1], steps, 0)                     # the prompt through torch's prefill
    forward(prompt[:-1], verify, 0)
    one = torch.cat([forward(t[None], steps, 1) for t in torch.cat([prompt[-1:], drafts])])
    assert forward._graph() is not None                # chosen, and it passed its check
    rows = forward(torch.cat([prompt[-1:], drafts]), verify, 7)
    assert torch.equal(rows, one)                      # bit for bit, whatever the rows
    assert steps.length == verify.length == len(ids)
    with torch.no_grad():
        exact = reference(ids[None]).logits[0, 4:].float()
    error = float((rows - exact).norm() / exact.norm())
    assert error < 0.05, error                         # int8 activations against fp32 arithmetic
    assert f"forward decode every call: {name}" in kernel_choices.choices()
    graph = forward._graph()
    if name == "ggml-graph-repacked":                  # every Q4_K weight laid out anew; calls of 3 rows
        assert graph.repacked == 7 * 2 and graph.chunk_rows == ggml.REPACK_ROWS
    else:
        assert graph.repacked == 0 and graph.chunk_rows == ggml.CHUNK_ROWS


@pytest.mark.parametrize("name", ["ggml-graph", "ggml-graph-repacked"])
def test_a_calls_logits_do_not_depend_on_what_shares_its_forward(tmp_path, pinned, name):
    needs_layout(name)
    model, _ = tiny_qwen(tmp_path)
    pinned(name)
    forward = lean.LeanForward(model)
    forward.batch_invariant = True   # two sessions' calls keep their own bits (else: lean's `_gathered`)
    a, b, c = (torch.tensor(t) for t in ([9, 8, 7, 6, 5, 4], [1, 2, 3], [30, 31, 32, 33, 34, 35, 36, 37, 38]))

    def fresh():
        cache_a, cache_b, cache_c = forward.new_cache(), forward.new_cache(), forward.new_cache()
        forward(a, cache_a, 0)
        forward(b, cache_b, 0)
        return cache_a, cache_b, cache_c
    cache_a, cache_b, cache_c = fresh()
    alone = [forward(torch.tensor([11]), cache_a, 1), forward(torch.tensor([12, 13, 14, 15, 16]), cache_b, 5)]
    cache_a, cache_b, cache_c = fresh()
    # A decode row and a 5-row verification in one forward (their rows share graphs), beside a
    # prefill chunk, which stays on torch's path.
    together = forward.batch([(torch.tensor([11]), cache_a, 1), (c, cache_c, 0),
                              (torch.tensor([12, 13, 14, 15, 16]), cache_b, 5)])
    assert torch.equal(together[0], alone[0]) and torch.equal(together[2], alone[1])
    assert together[1].numel() == 0
    assert (cache_a.length, cache_b.length, cache_c.length) == (7, 8, 9)


def test_a_failed_graph_call_leaves_the_cache_as_it_was(tmp_path, pinned, monkeypatch):
    model, _ = tiny_qwen(tmp_path, layers=1)
    pinned("ggml-graph")
    forward = lean.LeanForward(model)
    cache = forward.new_cache()
    forward(torch.tensor([1, 2, 3]), cache, 0)
    want = forward(torch.tensor([4]), cache, 1)
    cache.crop(3)
    real, failing = ggml_forward.GraphForward.rows, [True]

    def rows(self, *args):
        if failing[0]:
            raise RuntimeError("boom")
        return real(self, *args)
    monkeypatch.setattr(ggml_forward.GraphForward, "rows", rows)
    with pytest.raises(RuntimeError, match="boom"):
        forward(torch.tensor([4]), cache, 1)
    assert cache.length == 3
    failing[0] = False
    assert torch.equal(forward(torch.tensor([4]), cache, 1), want)


def test_where_the_repacked_kernels_fail_their_probe_the_plain_blocks_are_timed_against_torch(
        tmp_path, pinned, monkeypatch):
    model, _ = tiny_qwen(tmp_path, layers=1)
    monkeypatch.setattr(ggml, "repack_usable", lambda ggml_type: False)
    timed = []
    real_pick = kernel_choices.pick

    def pick(key, rows, calls, per_layer=False):
        if key[:2] == ggml_forward.KEY:
            timed.append(list(calls))
        return real_pick(key, rows, calls, per_layer)
    monkeypatch.setattr(kernel_choices, "pick", pick)
    forward = lean.LeanForward(model)
    forward._graph()
    assert timed == [["torch", "ggml-graph"]]


def test_models_it_does_not_cover_and_a_pinned_choice_keep_torchs_forward(tmp_path, pinned, caplog):
    plain = Qwen2ForCausalLM(Qwen2Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER,
                                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                         use_sliding_window=False)).eval()
    with caplog.at_level("INFO", logger="specdec.runtime.ggml_forward"):
        assert lean.LeanForward(plain)._graph() is None       # bf16/fp32 Linears: no GGUF blocks
    assert "the ggml graph does not cover a Linear without GGUF blocks" in caplog.text
    model, _ = tiny_qwen(tmp_path, layers=1)
    pinned("torch")
    forward = lean.LeanForward(model)
    assert forward._graph() is None
    assert kernel_choices.choices() == ["forward decode every call: torch"]


@pytest.mark.parametrize("fault, reason", [
    ("rows", "a row's logits changed with the rows beside it in a call"),
    ("scale", "relative error"),
])
def test_a_graph_that_fails_its_check_is_refused_and_torch_runs(tmp_path, pinned, monkeypatch, caplog, fault, reason):
    model, _ = tiny_qwen(tmp_path, layers=1)
    pinned("ggml-graph")   # chosen, so only the check stands between the graph and the calls
    forward = lean.LeanForward(model)
    real = ggml_forward.GraphForward.rows

    def faulty(self, x, caches, positions, kept):
        logits = real(self, x, caches, positions, kept)
        if fault == "rows":   # a row's result moved by the rows beside it
            return logits + 1e-3 * (x.shape[0] - 1)
        return logits * 2     # another model's logits
    monkeypatch.setattr(ggml_forward.GraphForward, "rows", faulty)
    with caplog.at_level("WARNING", logger="specdec.runtime.ggml_forward"):
        assert forward._graph() is None
    assert "failed its check" in caplog.text and reason in caplog.text
    cache, reference = forward.new_cache(), lean.LeanForward(model)
    got = forward(torch.tensor([3, 1, 4]), cache, 3)
    assert torch.equal(got, reference._batch([(torch.tensor([3, 1, 4]), reference.new_cache(), 3)])[0])
