"""INT8 off the CPU (quant.int8_device, a GPU's draft), run here on the CPU: the
per-channel codes computed weight-only in the model's dtype, fused layers that
compute what their parts did, a restricted head, and the static step over such a
model compiled whole (no graph break) giving the lean forward's logits."""
from __future__ import annotations

import torch
from torch import nn
from transformers import Qwen2Config, Qwen2ForCausalLM

from specdec.runtime import lean
from specdec.runtime.kv_arena import KVArena
from specdec.runtime.paged_step import PagedRunner
from specdec.runtime.quant import int8_device, quantizations
from specdec.runtime.quant.base import fuse
from specdec.runtime.quant.int8 import Int8RestrictedHead

quantizations()   # registers the fusable kinds


def qwen(seed: int = 0) -> Qwen2ForCausalLM:
    config = Qwen2Config(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).eval()


def test_a_layer_multiplies_by_its_rows_rounded_to_127_levels_and_keeps_activations_as_they_are():
    torch.manual_seed(1)
    linear = nn.Linear(64, 48).requires_grad_(False)
    with torch.no_grad():
        linear.weight[3] *= 50                       # one loud row: its own scale, the others' untouched
    layer = int8_device.Int8DeviceLinear.from_linear(linear, torch.float32)
    assert layer.codes.dtype == torch.int8 and int(layer.codes.abs().max()) == 127
    error = (layer.dense_weight() - linear.weight).abs()
    assert bool((error <= layer.scales[:, None] / 2 + 1e-7).all())      # each weight within half a step of its row's
    assert float(error[0].max()) < float(error[3].max()) / 10
    x = torch.randn(5, 64) * torch.logspace(0, 3, 64)                  # outlier channels, as a down projection's input
    expected = x @ layer.dense_weight().T + linear.bias
    assert torch.allclose(layer(x), expected, rtol=1e-5, atol=1e-3)
    # A row's output is its own, up to the matmul's summation order (no scale shared with the
    # others), and the channels spanning 1,000x kept as they are, where an int8 activation would not.
    assert torch.allclose(layer(x[2:3]), layer(x)[2:3], rtol=1e-5, atol=1e-3)


def test_fused_layers_compute_what_their_parts_did_and_hold_no_weight_twice():
    torch.manual_seed(2)
    parts = [int8_device.Int8DeviceLinear.from_linear(nn.Linear(32, n, bias=b), torch.float32)
             for n, b in ((32, True), (16, False), (16, True))]
    x = torch.randn(3, 32)
    alone = [p(x) for p in parts]
    fused = fuse(parts)
    assert isinstance(fused, int8_device.Int8DeviceLinear) and fused.out_features == 64
    assert torch.allclose(fused(x), torch.cat(alone, -1), atol=1e-6)
    for p, before in zip(parts, alone):
        assert p.codes.untyped_storage().data_ptr() == fused.codes.untyped_storage().data_ptr()
        assert torch.allclose(p(x), before, atol=1e-6)
    assert fuse([parts[0], nn.Linear(32, 8)]) is None                   # a plain Linear beside them: not this kind


def test_a_quantized_model_keeps_the_heads_ids_and_stays_near_its_weights():
    model, reference = qwen(), qwen()
    keep = torch.tensor([0, 5, 17, *range(100, 200)])
    int8_device.quantize_model(model, model.get_output_embeddings(), keep)
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert isinstance(model.get_output_embeddings(), Int8RestrictedHead)
    assert model.get_input_embeddings().weight.dtype == torch.float32   # the lookup keeps its rows
    ids = torch.tensor([[1, 40, 7, 99, 150, 3]])
    with torch.no_grad():
        got, want = model(ids).logits[0], reference(ids).logits[0]
    dropped = torch.ones(300, dtype=torch.bool)
    dropped[keep] = False
    assert bool(torch.isinf(got[:, dropped]).all()) and bool(torch.isfinite(got[:, keep]).all())
    assert float((got[:, keep] - want[:, keep]).abs().max()) < 0.05 * float(want[:, keep].abs().max())


def test_a_step_of_the_int8_model_reads_half_the_bf16_ones_bytes_however_its_layers_are_fused():
    from specdec_tools.gpu.static import read_bytes
    model = qwen().bfloat16()
    bf16 = read_bytes(model)                                      # tied: the head reads the embedding
    assert 0 <= bf16 - 2 * sum(p.numel() for p in model.parameters()) <= 256   # and the rotary's frequencies
    int8_device.quantize_model(model, model.get_output_embeddings(), None)
    int8 = read_bytes(model)                                      # untied now: the lookup's rows are not read
    assert int8 == read_bytes(lean.LeanForward(model) and model)  # fused: the parts are views, counted once
    assert 0.5 * bf16 < int8 < 0.53 * bf16                        # one byte a weight, and the scales and norms


def test_the_static_step_over_an_int8_model_compiles_whole_and_gives_the_lean_forwards_logits():
    model = qwen()
    int8_device.quantize_model(model, model.get_output_embeddings(), torch.arange(0, 300, 2))
    forward = lean.LeanForward(model)
    assert all(isinstance(f, int8_device.Int8DeviceLinear) for layer in forward.layers
               for f in (layer.qkv, layer.gate_up))                      # q/k/v and gate/up fused, as on a GPU
    arena = KVArena(len(forward.layers), forward.kv_heads, forward.head_dim, 32, torch.float32, "cpu")
    runner = PagedRunner(forward, arena, 128, buckets=(1, 4), compile="aot_eager")   # fullgraph: raises on a break
    prompt, steps = [(3 * i + 1) % 290 + 2 for i in range(20)], [[7], [8, 9, 10], [11]]
    cache, sequence = forward.new_cache(), arena.new_sequence()
    forward(torch.tensor(prompt), cache, keep_last=0)
    runner.forward([(prompt, sequence, 0)])
    for ids in steps:
        expected = forward(torch.tensor(ids), cache, keep_last=len(ids))
        got = runner.forward([(ids, sequence, len(ids))])[0]
        assert torch.allclose(got, expected, atol=5e-5), (got - expected).abs().max()
        assert bool(torch.isinf(got[:, 1::2]).all())                    # the odd ids: not in the head
