"""The lean forward: the same logits as transformers' forward, over a static cache
that rolls back by moving its length; q/k/v and gate/up fused where int4 allows."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from specdec.runtime import dense_rows, kernel_choices, kernels, kv_cache, lean
from specdec.runtime.quant.int4 import GROUP, Int4Linear
from specdec.runtime.sequence import SequenceCache
from specdec.runtime.models import load_model


def hf_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([tokens])).logits[0].float()


def test_tiny_models_run_the_lean_forward_by_default_and_transformers_on_request():
    assert load_model("tiny-target").lean is not None
    assert load_model("tiny-target", forward="hf").lean is None


@pytest.mark.parametrize("rows", [1, 3, 6])
def test_lean_logits_equal_transformers_over_prefill_verify_and_rollback(tiny_target, rows):
    forward = tiny_target.lean
    cache = forward.new_cache()
    tokens = list(range(40, 90))
    forward(torch.tensor(tokens[:30]), cache, keep_last=1)                  # prefill
    got = forward(torch.tensor(tokens[30:30 + rows]), cache, keep_last=rows)
    assert torch.allclose(got, hf_logits(tiny_target.model, tokens[:30 + rows])[-rows:], atol=1e-5)
    cache.crop(31)                                                           # reject all but one
    assert cache.get_seq_length() == 31
    got = forward(torch.tensor([7, 8]), cache, keep_last=2)
    assert torch.allclose(got, hf_logits(tiny_target.model, tokens[:31] + [7, 8])[-2:], atol=1e-5)


@pytest.mark.parametrize("fused", [True, False])
def test_a_prefills_many_rows_give_transformers_logits_on_either_attention_path(tiny_target, monkeypatch, fused, kernel_state):
    # Rows >= dense_rows.MIN_ROWS may take torch's fused attention: from an empty
    # cache (causal) and after a cached prefix (masked), as the choice falls.
    tokens = [(13 * i + 5) % 500 for i in range(220)]
    forward = tiny_target.lean
    heads = (forward.heads, forward.kv_heads, forward.head_dim)
    for rows in (100, 120):  # both in the 65..128 bucket
        kernel_state.choices[("attention", *heads, "prefill", kernel_choices.bucket(rows))] = "sdpa" if fused else "bmm"
    cache = forward.new_cache()
    # fp32 sums over 100+ positions in another order: within 1e-4 of logits of size ~5.
    got = forward(torch.tensor(tokens[:100]), cache, keep_last=100)                # causal, from empty
    assert torch.allclose(got, hf_logits(tiny_target.model, tokens[:100]), atol=1e-4)
    got = forward(torch.tensor(tokens[100:220]), cache, keep_last=120)             # masked, after 100
    assert torch.allclose(got, hf_logits(tiny_target.model, tokens)[-120:], atol=1e-4)


def test_the_cache_grows_past_its_chunk_and_keeps_what_it_held(tiny_target):
    forward = tiny_target.lean
    tokens = [(i * 37) % 500 + 3 for i in range(kv_cache.CHUNK + 40)]
    cache = forward.new_cache()
    for start in range(0, len(tokens) - 1, 50):                              # grows several times
        forward(torch.tensor(tokens[start:min(start + 50, len(tokens) - 1)]), cache, keep_last=1)
    assert cache.buffer.shape[3] >= len(tokens) - 1 and cache.buffer.shape[3] % kv_cache.CHUNK == 0
    got = forward(torch.tensor(tokens[-1:]), cache, keep_last=1)[0]
    assert torch.allclose(got, hf_logits(tiny_target.model, tokens)[-1], atol=1e-4)


def test_sequence_cache_restore_crops_the_static_cache(tiny_target):
    seq = SequenceCache(tiny_target, [5, 6, 7, 8])
    seq.prefill()
    before = seq.snapshot()
    seq.forward([9, 10, 11], keep_last=1)
    seq.restore(before)
    assert seq.cached == 4 and seq.tokens == [5, 6, 7, 8]  # what still matches stays cached
    assert torch.allclose(seq.forward([12], keep_last=1)[0], hf_logits(tiny_target.model, [5, 6, 7, 8, 12])[-1],
                          atol=1e-5)


def _int4_everywhere(model: torch.nn.Module) -> None:
    """Every decoder Linear to int4 group-32 (min/max codes): enough to exercise fusion."""
    for parent in list(model.model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear):
                w = child.weight.detach().float()
                groups = w.view(w.shape[0], -1, GROUP)
                low, high = groups.amin(-1), groups.amax(-1)
                scale = ((high - low) / 15).clamp(min=1e-6)
                codes = ((groups - low[..., None]) / scale[..., None]).round().clamp(0, 15).view_as(w)
                setattr(parent, name, Int4Linear(codes.to(torch.uint8), scale, -low, child.bias))


def _tiny_int4_forward(heads: int = 2, kv_heads: int = 1) -> lean.LeanForward:
    """The lean forward of a 2-layer bf16 Qwen2 whose decoder Linears are all int4."""
    config = Qwen2Config(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16).eval()
    _int4_everywhere(model)
    return lean.LeanForward(model)


def test_int4_qkv_and_gate_up_are_fused_and_give_transformers_logits():
    config = Qwen2Config(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16).eval()
    _int4_everywhere(model)
    reference = hf_logits(model, list(range(3, 40)))[-4:]
    forward = lean.LeanForward(model)
    assert all(layer.qkv is not None and layer.gate_up is not None for layer in forward.layers)
    cache = forward.new_cache()
    forward(torch.arange(3, 36), cache, keep_last=1)
    got = forward(torch.arange(36, 40), cache, keep_last=4)
    assert torch.equal(got.argmax(-1), reference.argmax(-1))
    assert (got - reference).abs().max() < 0.05 * reference.abs().max()
    # The unfused modules now read the fused buffers and still compute the same thing.
    assert torch.allclose(hf_logits(model, list(range(3, 40)))[-4:], reference)


def test_other_families_say_why_they_take_transformers_forward():
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2)
    model = LlamaForCausalLM(config)
    assert lean.supports(model) is None
    model.config.model_type = "gpt2"
    assert "gpt2" in lean.supports(model)


@pytest.mark.parametrize("prefill_rows", [70, 20])
def test_a_calls_logits_do_not_depend_on_a_prefill_sharing_its_forward(monkeypatch, prefill_rows, kernel_state):
    # A batched forward of a prefill chunk and a 3-row verify call: the chunk may take the
    # dense path (at any size: it keeps no logits), the 3-row call's rows must still take
    # the kernel, as they would alone, and the chunk's the path its own rows take alone.
    forward = _tiny_int4_forward()
    # bf16 dense matmuls, whose bits differ from the kernel's: which path a row took then shows.
    monkeypatch.setattr(dense_rows, "matmul_dtype", lambda: torch.bfloat16)
    chosen = {("int4", layer.out_features, layer.in_features, "prefill", kernel_choices.bucket(prefill_rows)): "dense"
              for layer in forward.linears()}  # the dense path wherever the chunk's rows ask
    kernel_state.choices.update(chosen)
    prompt, draft = list(range(3, 23)), [40, 41, 42]
    other = [(7 * i) % 290 + 5 for i in range(prefill_rows)]

    def alone(tokens: list[int], feed: list[int], keep_last: int):
        cache = forward.new_cache()
        forward(torch.tensor(tokens), cache, keep_last=1)
        return forward(torch.tensor(feed), cache, keep_last=keep_last), cache

    want, _ = alone(prompt, draft, 3)
    prefilled = forward.new_cache()
    forward(torch.tensor(prompt), prefilled, keep_last=1)
    fresh = forward.new_cache()
    got = forward.batch([(torch.tensor(other), fresh, 0), (torch.tensor(draft), prefilled, 3)])[1]
    assert torch.equal(got, want)
    chunk_alone = forward.new_cache()
    forward(torch.tensor(other), chunk_alone, keep_last=0)  # alone: the dense path, as chosen above
    assert torch.equal(fresh.buffer[:, :, :, :prefill_rows], chunk_alone.buffer[:, :, :, :prefill_rows])
    if prefill_rows < dense_rows.MIN_ROWS:  # the same rows keeping logits: the kernel, whose keys differ
        kernel_cache = forward.new_cache()
        forward(torch.tensor(other), kernel_cache, keep_last=1)
        assert not torch.equal(kernel_cache.buffer[:, :, :, :prefill_rows], chunk_alone.buffer[:, :, :, :prefill_rows])
    assert {k: v for k, v in kernel_state.choices.items() if k[0] == "int4"} == chosen  # no other bucket was asked


def test_prefill_chunks_sharing_a_forward_each_take_their_own_buckets_path(monkeypatch, kernel_state):
    # Two sessions' prefill chunks beside a verify call: the 20-row chunk's bucket chose the
    # dense path, the 8-row chunk's the kernel, and a 30-row chunk's bucket is not timed yet.
    # Under --batch-invariant each chunk's keys and values, and the verify call's logits, must
    # be what each gives alone, bit for bit, whatever their rows add up to (by default several
    # chunks share each layer's call: test_gathered).
    forward = _tiny_int4_forward()
    forward.batch_invariant = True
    for layer in forward.linears():
        shape = ("int4", layer.out_features, layer.in_features, "prefill")
        kernel_state.choices[(*shape, kernel_choices.bucket(20))] = "dense"
        kernel_state.choices[(*shape, kernel_choices.bucket(8))] = "kernel"
    chunks = {n: [(11 * i + n) % 290 + 5 for i in range(n)] for n in (20, 8, 30)}

    def alone_kv(tokens: list[int]) -> torch.Tensor:
        cache = forward.new_cache()
        forward(torch.tensor(tokens), cache, keep_last=0)
        return cache.buffer[:, :, :, :len(tokens)].clone()

    prompt, draft = list(range(3, 23)), [40, 41, 42]
    prefilled = forward.new_cache()
    forward(torch.tensor(prompt), prefilled, keep_last=1)
    want = forward(torch.tensor(draft), prefilled, keep_last=3)
    prefilled.length -= 3  # rolled back: the same three rows again, batched
    caches = {n: forward.new_cache() for n in chunks}
    got = forward.batch([(torch.tensor(chunks[20]), caches[20], 0), (torch.tensor(chunks[8]), caches[8], 0),
                         (torch.tensor(chunks[30]), caches[30], 0), (torch.tensor(draft), prefilled, 3)])[3]
    assert torch.equal(got, want)
    for n, tokens in chunks.items():
        assert torch.equal(caches[n].buffer[:, :, :, :n], alone_kv(tokens)), n
    asked = {k[-1] for k in kernel_state.choices if k[0] == "int4"}
    assert asked == {kernel_choices.bucket(20), kernel_choices.bucket(8), kernel_choices.bucket(30)}  # never the 58 rows' bucket


def test_a_verify_calls_logits_and_keys_are_a_decode_steps_to_the_bit():
    # Greedy speculative output equals target-only output only if a verify call's row gives
    # what a one-row decode step at that position gives, bit for bit: over every prefix
    # length and call size, including the short ones where a masked call's reductions over
    # its whole length would round differently. The int4 target, whose kernels compute each
    # row on its own (a float32 nn.Linear's GEMM does not: its rows vary with the call's).
    forward = _tiny_int4_forward(heads=4, kv_heads=2)
    tokens = [(13 * i + 7) % 290 + 5 for i in range(60)]
    for prefix in (1, 3, 5, 9, 17, 33):
        steps = forward.new_cache()
        forward(torch.tensor(tokens[:prefix]), steps, keep_last=0)
        want = torch.cat([forward(torch.tensor([t]), steps, keep_last=1) for t in tokens[prefix:prefix + 9]])
        for rows in (2, 3, 5, 9):
            cache = forward.new_cache()
            forward(torch.tensor(tokens[:prefix]), cache, keep_last=0)
            got = forward(torch.tensor(tokens[prefix:prefix + rows]), cache, keep_last=rows)
            assert torch.equal(got, want[:rows]), (prefix, rows)
            end = prefix + rows
            assert torch.equal(cache.buffer[:, :, :, :end], steps.buffer[:, :, :, :end]), (prefix, rows)


def test_warm_up_can_time_every_prefill_bucket_a_chunk_can_meet(monkeypatch, kernel_state):
    # A request's first prefill of a new size must not pay for timing its paths: warm-up
    # has timed each row bucket a chunk of up to --prefill-chunk rows falls in.
    from types import SimpleNamespace

    from specdec.runtime.device import policy
    from specdec.runtime.sequence import SequenceCache
    from specdec.service.warm_up import time_prefill_buckets
    forward = _tiny_int4_forward()
    loaded = SimpleNamespace(lean=forward, device=torch.device("cpu"), policy=policy("cpu"), vocab_size=300,
                             tokenizer=SimpleNamespace(encode=lambda text, add_special_tokens: [5, 6]))
    time_prefill_buckets(loaded, prefill_chunk=20)
    layer = forward.linears()[0]
    timed = {k[-1] for k in kernel_state.choices if k[:4] == ("int4", layer.out_features, layer.in_features, "prefill")}
    assert timed == {2, 3, 4, 5, 6, 7, 8, 16, 32}
    before = dict(kernel_state.choices)
    SequenceCache(loaded, list(range(3, 17))).prefill()   # 13 rows: a bucket timed already
    assert kernel_state.choices == before


@pytest.mark.skipif("avx2" not in kernels.cpu_flags(), reason="fbgemm's int8 GEMM runs on AVX2 CPUs")
def test_rows_of_several_sessions_take_the_batch_kernel_unless_batch_invariant(monkeypatch, kernel_state):
    # gate/up offer int8 kernels beside torch's int4 one. A session alone, and a batch
    # under --batch-invariant, keep the one kernel chosen for every call (int4 here); a
    # batch of two sessions' decode rows takes its bucket's choice for decode rows (int8
    # here), whose logits are close to, and not, each session's own bits.
    config = Qwen2Config(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16).eval()
    _int4_everywhere(model)
    for module in model.modules():
        if isinstance(module, Int4Linear):
            module.int8_activations = True
    forward = lean.LeanForward(model)
    gate_up = forward.layers[0].gate_up
    assert "fbgemm-int8-row" in {b.name for b, _ in gate_up._accelerated()}
    shape = ("int4", gate_up.out_features, gate_up.in_features)
    kernel_state.choices[(*shape, 0)] = "torch-int4"
    kernel_state.choices[(*shape, "gathered-decode", kernel_choices.bucket(2))] = "fbgemm-int8-row"
    prompts = [list(range(3, 20)), [7 * i % 290 + 5 for i in range(11)]]

    def prefilled() -> list:
        caches = []
        for prompt in prompts:
            caches.append(forward.new_cache())
            forward(torch.tensor(prompt[:-1]), caches[-1], keep_last=1)
        return caches
    caches = prefilled()
    alone = [forward(torch.tensor(p[-1:]), c, keep_last=1) for p, c in zip(prompts, caches)]

    def batched(invariant: bool) -> list[torch.Tensor]:
        forward.batch_invariant = invariant
        return forward.batch([(torch.tensor(p[-1:]), c, 1) for p, c in zip(prompts, prefilled())])
    assert all(torch.equal(a, b) for a, b in zip(alone, batched(True)))
    gathered = batched(False)
    for a, b in zip(alone, gathered):
        assert not torch.equal(a, b) and (a - b).norm() < 0.05 * a.norm()
    assert any("gathered-decode rows<=2: fbgemm-int8-row" in line for line in kernel_choices.choices())
    again = prefilled()  # one session's rows after the batch: its own bits still
    assert torch.equal(forward(torch.tensor(prompts[0][-1:]), again[0], keep_last=1), alone[0])


def test_gathered_decode_rows_run_between_linears_on_one_thread_and_give_the_threads_back(monkeypatch, kernel_state):
    # A batch of several sessions' decode rows runs every op between the linear layers (the
    # norms, attention) on one torch thread (two threads' wake-ups cost more than their few KB
    # of work) and the linear layers on the process's threads, to the same bits as with every
    # op on those. A session alone keeps the process's threads throughout; a batch with a
    # prefill chunk runs only the decode rows' attention on one; the threads come back, also
    # after an attention that failed.
    forward = _tiny_int4_forward()
    seen = {"attention": [], "norm": [], "linear": []}
    real_attention, real_norm = lean.bmm_attention, lean.rms_norm

    def attention(*args):
        seen["attention"].append(torch.get_num_threads())
        return real_attention(*args)

    def norm(*args):
        seen["norm"].append(torch.get_num_threads())
        return real_norm(*args)
    monkeypatch.setattr(lean, "bmm_attention", attention)
    monkeypatch.setattr(lean, "rms_norm", norm)
    for module in forward.linears() + [forward.lm_head]:
        module.register_forward_pre_hook(lambda *_: seen["linear"].append(torch.get_num_threads()))

    def threads() -> dict[str, set[int]]:
        out = {name: set(values) for name, values in seen.items()}
        for values in seen.values():
            values.clear()
        return out
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        caches = [forward.new_cache() for _ in range(3)]
        for j, cache in enumerate(caches):
            forward(torch.tensor([5 + j, 6, 7]), cache, keep_last=1)
        threads()
        forward(torch.tensor([9]), caches[0], keep_last=1)
        assert threads() == {"attention": {2}, "norm": {2}, "linear": {2}}

        def decode_rows(light: bool) -> list[torch.Tensor]:
            for cache in caches[:2]:
                cache.length = 3
            with kernel_choices.gathered(True), torch.inference_mode():
                return forward._batch([(torch.tensor([9]), caches[0], 1), (torch.tensor([10, 11]), caches[1], 2)],
                                      one_call=True, light_threads=1 if light else 0)
        alone = decode_rows(light=False)
        threads()
        light = decode_rows(light=True)
        assert threads() == {"attention": {1}, "norm": {1}, "linear": {2}}
        assert all(torch.equal(a, b) for a, b in zip(alone, light))
        assert torch.get_num_threads() == 2

        # Through `batch`: several sessions' decode rows take the light threads; beside a
        # prefill chunk, only the decode rows' attention runs on one thread.
        for cache in caches[:2]:
            cache.length = 3
        forward.batch([(torch.tensor([9]), caches[0], 1), (torch.tensor([10]), caches[1], 1)])
        assert threads() == {"attention": {1}, "norm": {1}, "linear": {2}}
        forward.batch([(torch.tensor([12]), caches[0], 1), (torch.tensor([13]), caches[1], 1),
                       (torch.tensor([1, 2, 3, 4]), caches[2], 0)])
        assert threads() == {"attention": {1, 2}, "norm": {2}, "linear": {2}}

        def failing(*args):
            raise RuntimeError("attention failed")
        monkeypatch.setattr(lean, "bmm_attention", failing)
        with pytest.raises(RuntimeError, match="attention failed"):
            forward.batch([(torch.tensor([12]), caches[0], 1), (torch.tensor([13]), caches[1], 1)])
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
