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

Each Linear's weight is rounded to Q4_0 by gguf's own quantizer. A Q4_0 block is
int4 group-32 quantization already (w = d * (q - 8)), so the layer is an Int4Linear
over the blocks' own codes, scale d and minimum 8d, holding the blocks beside them:
ggml takes the blocks as they are (the graph, and the per-layer ggml kernel), torch's
int4 kernel and a prefill's dense rows the same codes, so a prompt's keys and values
come from the weights its decode steps use, and the per-layer ggml kernel is checked
against them. torch packs int4 rows in 16s: a layer of other rows (a head cut to N
ids plus the special ones) is an Int8WeightOnlyLinear holding the blocks, which torch
runs as their values rounded to int8 a row. The LM head may be cut to the head_vocab
ids the target writes most, as the INT8 draft's is; the input embedding keeps its rows.
"""
from __future__ import annotations

import logging

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from torch import nn

from specdec.rpc.errors import FailedPrecondition
from specdec.runtime.quant.base import Quantization, QuantizeContext, register
from specdec.runtime.quant.int4 import Int4Linear
from specdec.runtime.quant.int8 import Int8RestrictedHead, Int8WeightOnlyLinear, head_keep_ids

Q4_0 = GGMLQuantizationType.Q4_0
BLOCK = 32   # weights a Q4_0 block holds along a row
PACK_ROWS = 16   # torch's int4 CPU packing takes output rows in multiples of this
log = logging.getLogger(__name__)


def q4_0_codes(blocks: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_0 bytes [rows, cols/32 * 18] -> (codes uint8 [rows, cols] in 0..15, d float32
    [rows, cols/32]), with weight = d * (codes - 8), group by group of 32 along a row."""
    raw = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(-1, 2 + BLOCK // 2)
    assert raw.shape[0] == rows * cols // BLOCK, (blocks.shape, rows, cols)
    d = raw[:, :2].copy().view(np.float16).astype(np.float32)                   # [n, 1]
    qs = raw[:, 2:]                                                             # [n, 16]
    codes = np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=1)     # weights 0..15, then 16..31
    return codes.reshape(rows, cols), d.reshape(rows, cols // BLOCK)


def q4_0_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Module:
    """A Linear's weight [N, K] (K a multiple of 32) as Q4_0 blocks, in a layer both ggml and torch run."""
    assert weight.dim() == 2 and weight.shape[1] % BLOCK == 0, weight.shape
    rows, cols = weight.shape
    blocks = quantize(weight.detach().float().cpu().numpy(), Q4_0)              # uint8 [N, K/32 * 18]
    held = torch.from_numpy(blocks.reshape(rows, -1))
    if rows % PACK_ROWS:
        values = torch.from_numpy(dequantize(blocks, Q4_0).reshape(rows, cols))
        return Int8WeightOnlyLinear(values, bias, blocks=held, ggml_type=int(Q4_0))
    codes, d = (torch.from_numpy(a) for a in q4_0_codes(blocks, rows, cols))
    layer = Int4Linear(codes, d, 8 * d, blocks=held, ggml_type=int(Q4_0))
    if bias is not None:    # fp32, as the draft computes (Int4Linear keeps its own dtype's)
        layer.bias = bias.detach().float()
    return layer


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


register(Quantization("q4_0", quantize_model, lambda dtype, device: "fp32+q4_0", uses_head_vocab=True))
