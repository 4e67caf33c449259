"""Q4_0 blocks made from a model's own weights, for llama.cpp's kernels: a draft's quantization.

A draft need not compute what any other model computes (whatever it proposes, the
rejection sampler keeps the target's distribution), only cheaply and close enough
to the target to be kept. Q4_0 is the format ggml multiplies fastest on x86: 32
weights a block, one fp16 scale and 4-bit codes, laid out at load for its GEMV
(the repack buffer, specdec.runtime.ggml). On the 0.5B's shapes at one row, on an
AVX-512 EPYC, that GEMV took 0.126 ms for the fused gate/up (9,728 x 896) where
fbgemm's int8 GEMM of the INT8 draft takes 0.154, and 0.52 ms for a head of 32,768
ids against 0.90; the rest of an INT8 draft step is some 50 torch ops a layer,
which the ggml graph (specdec.runtime.ggml_forward) runs as one call.

Each Linear's weight is rounded to Q4_0 by gguf's own quantizer and becomes an
Int8WeightOnlyLinear holding those blocks: ggml takes them as they are (the graph,
and the per-layer ggml kernel), and torch's paths (a prefill's dense rows, and
every call where llama-cpp-python does not install) the same values at int8 a
row. The LM head may be cut to the head_vocab ids the target writes most, as the
INT8 draft's is; the input embedding keeps its rows.
"""
from __future__ import annotations

import logging

import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from torch import nn

from specdec.rpc.errors import FailedPrecondition
from specdec.runtime.quant.base import Quantization, QuantizeContext, register
from specdec.runtime.quant.int8 import Int8RestrictedHead, Int8WeightOnlyLinear, head_keep_ids

Q4_0 = GGMLQuantizationType.Q4_0
BLOCK = 32   # weights a Q4_0 block holds along a row
log = logging.getLogger(__name__)


def q4_0_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int8WeightOnlyLinear:
    """A Linear's weight [N, K] (K a multiple of 32) as Q4_0 blocks, in a layer both ggml and torch run."""
    assert weight.dim() == 2 and weight.shape[1] % BLOCK == 0, weight.shape
    rows, cols = weight.shape
    blocks = quantize(weight.detach().float().cpu().numpy(), Q4_0)              # uint8 [N, K/32 * 18]
    values = torch.from_numpy(dequantize(blocks, Q4_0).reshape(rows, cols))
    return Int8WeightOnlyLinear(values, bias, blocks=torch.from_numpy(blocks.reshape(rows, -1)),
                                ggml_type=int(Q4_0))


def quantize_model(model: nn.Module, ctx: QuantizeContext) -> nn.Module:
    """Every nn.Linear of `model` in Q4_0, in place (fp32 elsewhere); a Linear whose input size
    is not a whole number of blocks keeps int8 weights alone, and says so."""
    if ctx.device.type != "cpu":
        raise FailedPrecondition(f"--quantize q4_0 runs ggml's CPU kernels; use int4 or int8 on {ctx.device.type}")
    model = model.float()
    head = model.get_output_embeddings()
    kept = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear) or child is head:
                continue
            if child.in_features % BLOCK:
                setattr(parent, name, Int8WeightOnlyLinear(child.weight.detach(), child.bias))
                kept += 1
            else:
                setattr(parent, name, q4_0_linear(child.weight, child.bias))
    if kept:
        log.info("%s: %d Linear layers with inputs not a multiple of %d stay int8", ctx.name, kept, BLOCK)
    if head is not None:
        weight = head.weight.detach()
        if weight.shape[1] % BLOCK:
            new_head = Int8WeightOnlyLinear(weight, getattr(head, "bias", None))
        elif 0 < ctx.head_vocab < weight.shape[0]:
            keep = head_keep_ids(weight.shape[0], ctx.head_vocab, list(ctx.special_ids), ctx.vocab_ranking)
            new_head = Int8RestrictedHead(weight, keep, weight.shape[0], head=q4_0_linear(weight[keep]))
        else:
            new_head = q4_0_linear(weight, getattr(head, "bias", None))
        model.config.tie_word_embeddings = False   # the embedding keeps its fp32 rows (a lookup)
        model.set_output_embeddings(new_head)
    return model


register(Quantization("q4_0", quantize_model, lambda dtype: "fp32+q4_0", uses_head_vocab=True))
