"""int4 weights straight from a GGUF's Q4_K blocks, for torch's int4 weight-only kernel.

A Q4_K super-block holds 256 weights as 8 sub-blocks of 32: 4-bit codes q in
0..15, and per sub-block a 6-bit scale and a 6-bit min under the block's fp16 d
and dmin, so w = d*sc * q - dmin*m. That is int4 group-32 affine quantization
already: the codes carry over as they are (no second rounding of the weights).
torch's CPU kernel (`_weight_int4pack_mm_for_cpu`) computes w = (q - 8) * scale +
zero, so scale = d*sc and zero = 8*scale - dmin*m. Its fast path runs bf16
activations with bf16 scales and zeros: those two are rounded to bf16 (8
significant bits), the codes never are. (fp32 activations would keep the scales
exact, but that path is about 50x slower here: 10 ms against 0.2 for one row of a
1536 x 8960 weight.)
"""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGML_QUANT_SIZES
from gguf.quants import Q4_K
from torch import nn

import logging

from specdec.runtime import dense_rows, kernel_choices, kernels
from specdec.runtime.quant.base import Quantization, QuantizeContext, register
from specdec.runtime.quant.int8 import Int8WeightOnlyLinear, per_row_int8

GROUP = 32
INNER_K_TILES = 2  # the packing layout the CPU kernel expects with this group size
PACK_BLOCK_ROWS = 64  # row granularity of reads and fused parts: a whole number of any packing block
# The Q4_K layers offered int8 activations (per row) besides torch's int4 kernel: the MLP's
# gate and up projections, whose input is a norm's output. On the 1.5B they kept the target's
# top-1 agreement with fp32; the attention projections' weights, re-rounded to int8, are off
# by 5% of their output (the kernel check's 3% leaves them out anyway), and the 4-bit down
# projections, re-rounded, failed it on some layers and took top-1 under 0.99 (docs/kernels.md).
INT8_ACTIVATION_LAYERS = ("mlp.gate_proj", "mlp.up_proj")
# ...through kernels keeping at least this many bits of a row: the first position's hidden state
# (the attention sink) carries channels hundreds of times the others, even after the norm, and
# 8 bits a row left the 1.5B's logits 60% off over 8 tokens from position 0 (the ggml graph's
# check caught it) where 14 bits kept them within 3%.
GATE_UP_BITS = 14
# Several sessions' decode and verify rows, none at position 0, in one forward: 8 bits a row.
# Teacher-forced over 6 dev prompts x 48 tokens in batches of 6, the logits stayed as far from
# the exact one-session path's as the 14-bit kernels left them (2.9% against 2.7% median, the
# same top-1 on 281 and 280 of 288), at a third of the time (0.47 against 1.36 ms, 8 rows).
DECODE_ROWS_BITS = 8


def q4k_codes(raw: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Q4_K tensor's raw bytes -> (codes uint8 [rows, cols] in 0..15,
    scale float32 [rows, cols/32], minimum float32 [rows, cols/32]), with
    weight = codes * scale - minimum, group by group of 32 along a row."""
    block_weights, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType.Q4_K]
    assert cols % block_weights == 0, (rows, cols)
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, block_bytes)
    assert blocks.shape[0] == rows * cols // block_weights, (blocks.shape, rows, cols)
    n = blocks.shape[0]
    d, rest = np.hsplit(blocks, [2])
    dmin, rest = np.hsplit(rest, [2])
    scales, qs = np.hsplit(rest, [Q4_K.K_SCALE_SIZE])
    sc, m = Q4_K.get_scale_min(scales)                                              # [n, 8] each
    scale = d.copy().view(np.float16).astype(np.float32) * sc.astype(np.float32)    # [n, 8]
    minimum = dmin.copy().view(np.float16).astype(np.float32) * m.astype(np.float32)
    # Each 32 bytes of qs hold two sub-blocks: low nibbles first, then high nibbles.
    nibbles = qs.reshape(n, -1, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    codes = (nibbles & np.uint8(0x0F)).reshape(rows, cols)
    groups = cols // GROUP
    return codes, scale.reshape(rows, groups), minimum.reshape(rows, groups)


def gguf_rows(raw: np.ndarray, rows: int) -> torch.Tensor:
    """A GGUF tensor's bytes as uint8 [rows, bytes per row], copied out of the file's mapping."""
    return torch.from_numpy(np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, -1).copy())


def unpack_codes(flat: torch.Tensor, n: int, k: int, start: int, end: int, block: int,
                 halves: bool) -> torch.Tensor:
    """Rows start..end ([end - start, K] uint8) of an [N, K] code matrix packed by
    torch's CPU int4 packing into `flat` bytes. Rows come in blocks of `block`
    (64 with AVX-512, 32 with AVX2), each stored [K, block/2] bytes: with `halves`,
    byte j holds row j (low nibble) and row j + block/2 (high); a last partial
    block of r rows (and, without `halves`, every block) is [K, r/2] bytes holding
    rows 2j (low) and 2j + 1 (high). start is on a block (end too, unless it is N)."""
    full = min(end, n // block * block)
    parts = []
    if full > start:
        blocks = flat[start * k // 2: full * k // 2].view(-1, k, block // 2)                 # [B, K, block/2]
        if halves:
            rows = torch.cat([blocks & 15, blocks >> 4], dim=2)                             # [B, K, block]
        else:
            rows = torch.stack([blocks & 15, blocks >> 4], dim=3).reshape(-1, k, block)
        parts.append(rows.transpose(1, 2).reshape(-1, k))
    if end > full:
        tail = flat[full * k // 2:].view(k, (n - full) // 2)                                   # [K, r/2]
        parts.append(torch.stack([tail & 15, tail >> 4], dim=2).reshape(k, n - full).t())      # [r, K]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


_LAYOUT: tuple[int, bool] | None = None
_LAYOUTS = ((64, True), (32, True), (32, False), (64, False))  # AVX-512, AVX2, the plain and others


def pack_layout() -> tuple[int, bool]:
    """How this machine's torch packs int4 codes (it depends on the CPU's vector
    width): found once by packing known codes and reading them back each way."""
    global _LAYOUT
    if _LAYOUT is None:
        n, k = 112, 64  # a partial last block for either block size
        probe = torch.randint(0, 16, (n, k), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
        flat = torch.ops.aten._convert_weight_to_int4pack_for_cpu(probe, INNER_K_TILES).reshape(-1)
        for layout in _LAYOUTS:
            if torch.equal(unpack_codes(flat, n, k, 0, n, *layout).to(torch.int32), probe):
                _LAYOUT = layout
                break
        else:
            raise RuntimeError("torch's int4 CPU packing is in none of the known layouts: "
                               "int4 weights cannot be unpacked for dense prefills")
    return _LAYOUT


class Int4Linear(nn.Module):
    """y = x W^T (+ b) with W in int4 group-32 (CPU: torch's int4 weight-only kernel).

    int8_activations: also offer the kernels that compute the weight re-rounded to int8
    per output channel against int8 activations scaled per row (specdec.runtime.kernels,
    `per_row`), each checked on the layer against the int4 kernel; one kernel then serves
    every call under dense_rows.MIN_ROWS, as timed on the first (a verification's rows must
    be the decode step's). torch's int4 kernel de-quantizes its weight once per 4 rows, so
    from 5 rows it costs twice what it does for 4; an int8 x int8 GEMM stays nearly flat.
    The int8 copy is made on the first call, outside the model cache."""

    ggml_type = int(GGMLQuantizationType.Q4_K)   # of `gguf_blocks`, where the layer has them

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                 bias: torch.Tensor | None = None, dtype: torch.dtype = torch.bfloat16,
                 int8_activations: bool = False, blocks: torch.Tensor | None = None, ggml_type: int | None = None):
        super().__init__()
        self.int8_activations = int8_activations
        if ggml_type is not None:    # blocks of another type than a GGUF's Q4_K (quant/q4_0.py's Q4_0)
            self.ggml_type = int(ggml_type)
        out_features, in_features = codes.shape                                     # codes [N, K] 0..15
        assert scale.shape == minimum.shape == (out_features, in_features // GROUP), (scale.shape, codes.shape)
        self.in_features, self.out_features = in_features, out_features
        scale_t = scale.to(dtype)
        # zero from the rounded scale, so the code 8 lands where d*sc*8 - dmin*m does.
        zero = (8 * scale_t.float() - minimum.float()).to(dtype)
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            codes.to(torch.int32).contiguous(), INNER_K_TILES))
        self.register_buffer("scales_and_zeros", torch.stack([scale_t.t(), zero.t()], dim=-1).contiguous())
        # The GGUF's own Q4_K bytes [N, K/256 * 144], where the layer came from a GGUF: the
        # kernels that take its blocks as they are (kernels' "gguf-blocks" backends) read these.
        self.register_buffer("gguf_blocks", None if blocks is None else blocks.reshape(out_features, -1).contiguous())
        self.register_buffer("bias", None if bias is None else bias.to(dtype))
        self.dtype = dtype

    @classmethod
    def from_q4k(cls, raw: np.ndarray, rows: int, cols: int, bias: torch.Tensor | None = None,
                 int8_activations: bool = False) -> "Int4Linear":
        codes, scale, minimum = q4k_codes(raw, rows, cols)
        return cls(torch.from_numpy(codes), torch.from_numpy(scale), torch.from_numpy(minimum), bias,
                   int8_activations=int8_activations, blocks=gguf_rows(raw, rows))

    @staticmethod
    def concatenable(parts: list) -> bool:
        """Whether `concat` can fuse these: Int4Linears sharing input size, dtype, bias-ness
        and block type, each but the last a whole number of the packing's 64-row blocks (a
        partial block is packed differently, so it can only come last)."""
        return all(isinstance(p, Int4Linear) for p in parts) \
            and len({(p.in_features, p.dtype, p.bias is None, p.ggml_type) for p in parts}) == 1 \
            and all(p.out_features % PACK_BLOCK_ROWS == 0 for p in parts[:-1])

    @classmethod
    def concat(cls, parts: list["Int4Linear"]) -> "Int4Linear":
        """One Int4Linear computing the parts' outputs side by side (q/k/v, gate/up): one
        kernel call instead of several, 1.5x faster on 4 rows here. The parts then read
        their weights out of the fused buffers (views), so nothing is held twice."""
        assert cls.concatenable(parts), [(p.in_features, p.out_features) for p in parts]
        fused = cls.__new__(cls)
        nn.Module.__init__(fused)
        fused.in_features, fused.out_features = parts[0].in_features, sum(p.out_features for p in parts)
        fused.dtype = parts[0].dtype
        fused.ggml_type = parts[0].ggml_type    # Q4_K from a GGUF; Q4_0 rounded at load (quant/q4_0.py)
        fused.int8_activations = all(p.int8_activations for p in parts)
        fused.register_buffer("packed", torch.cat([p.packed for p in parts]))                # [N, K/2]
        fused.register_buffer("scales_and_zeros", torch.cat([p.scales_and_zeros for p in parts], dim=1))
        fused.register_buffer("gguf_blocks", None if any(p.gguf_blocks is None for p in parts)
                              else torch.cat([p.gguf_blocks for p in parts]))
        fused.register_buffer("bias", None if parts[0].bias is None else torch.cat([p.bias for p in parts]))
        start = 0
        for p in parts:
            end = start + p.out_features
            p.packed = fused.packed[start:end]
            p.scales_and_zeros = fused.scales_and_zeros[:, start:end]
            if fused.gguf_blocks is not None:
                p.gguf_blocks = fused.gguf_blocks[start:end]
            if p.bias is not None:
                p.bias = fused.bias[start:end]
            start = end
        return fused

    def dequantized(self) -> torch.Tensor:
        """[N, K]: the weight the kernel applies, read out through an identity (so rounded
        once more to bf16 on the way out, as every output of the kernel is)."""
        eye = torch.eye(self.in_features, dtype=self.dtype)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            eye, self.packed, GROUP, self.scales_and_zeros).float().t().contiguous()

    def codes(self, start: int = 0, end: int | None = None) -> torch.Tensor:
        """[end - start, K] uint8 0..15: rows start..end of the codes, read back out of
        the kernel's packing (start, and end unless it is N, on 64-row blocks)."""
        n, k = self.out_features, self.in_features
        end = n if end is None else end
        assert start % PACK_BLOCK_ROWS == 0 and (end == n or end % PACK_BLOCK_ROWS == 0), (start, end)
        return unpack_codes(self.packed.reshape(-1), n, k, start, end, *pack_layout())

    def dense_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """[N, K] in the dense path's dtype (or `dtype`): w = (q - 8) * scale + zero = q * scale - min,
        per group of 32, computed in fp32 as the kernel does (q * scale and min nearly
        cancel where the weight is small, which bf16 steps would lose)."""
        n, k = self.out_features, self.in_features
        scale, zero = (t.t().float() for t in self.scales_and_zeros.unbind(-1))           # [N, K/32] each
        minimum = (8 * scale - zero)[:, :, None]
        scale = scale[:, :, None]

        def chunk(start: int, end: int) -> torch.Tensor:
            codes = self.codes(start, end).view(end - start, k // GROUP, GROUP).float()
            return codes.mul_(scale[start:end]).sub_(minimum[start:end]).view(end - start, k)
        return dense_rows.unpack(n, k, dtype or dense_rows.matmul_dtype(), chunk)

    def _int4(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, self.packed, GROUP, self.scales_and_zeros.contiguous())  # a fused layer's part holds a strided view

    def _accelerated(self) -> list[tuple[kernels.Backend, object]]:
        """The per-row kernels that take the GGUF's Q4_K blocks as they are, and with
        int8_activations those for this weight re-rounded to int8 per output channel, each
        checked against the int4 kernel; none where none runs."""
        accel = self.__dict__.get("_accel")
        if accel is None:
            reference = lambda x: self._int4(x.to(self.dtype))  # noqa: E731
            accel = []
            key = ("int4", self.out_features, self.in_features)
            if self.gguf_blocks is not None:
                accel += kernels.prepared("gguf-blocks", (self.gguf_blocks, self.ggml_type,
                                                          self.in_features), reference, per_row=True,
                                          in_features=self.in_features, key=key)
            decode_rows = []   # kernels keeping fewer bits of a row than GATE_UP_BITS: gathered decode rows'
            if self.int8_activations:
                for backend, state in kernels.prepared("int8-channel", lambda: per_row_int8(
                        self.dense_weight(torch.float32)), reference, per_row=True,
                        activation_bits=DECODE_ROWS_BITS, in_features=self.in_features, key=key):
                    (accel if backend.activation_bits >= GATE_UP_BITS else decode_rows).append((backend, state))
            self._accel, self._accel_decode_rows = accel, decode_rows
        return accel

    def __getstate__(self):
        # Saved in the model cache: the accelerated kernels' weights are this machine's, made again on load.
        return {k: v for k, v in self.__dict__.items() if k not in ("_accel", "_accel_decode_rows", "_kept_dense")}

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        accel = self._accelerated()
        return kernel_choices.pick_per_layer(("int4", self.out_features, self.in_features), x, "torch-int4", self._int4,
                                             accel, self.__dict__.get("_accel_decode_rows", ()))

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        return dense_rows.linear(x, dense_rows.weight(self, self.dense_weight))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).to(self.dtype)                             # [rows, K]
        y = dense_rows.run_rows(("int4", self.out_features, self.in_features), x2, self._kernel, self._dense,
                                kept=dense_rows.is_kept(self))
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group={GROUP}, int4"


# GGUF tensor names of the Llama/Qwen2 family -> the transformers module they load into.
_GGUF_LINEARS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                 "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                 "ffn_down": "mlp.down_proj"}


def module_name(gguf_name: str) -> str | None:
    """'blk.3.ffn_up.weight' -> 'model.layers.3.mlp.up_proj'; 'output.weight' -> 'lm_head'."""
    if gguf_name == "output.weight":
        return "lm_head"
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight" and parts[2] in _GGUF_LINEARS:
        return f"model.layers.{parts[1]}.{_GGUF_LINEARS[parts[2]]}"
    return None


def quantize_from_gguf(model: nn.Module, gguf_path: str) -> dict[str, int]:
    """Replace every Linear whose GGUF tensor is Q4_K by an Int4Linear built from its
    blocks; the others (Q6_K, Q5_0, Q8_0, ...: the LM head among them) go to int8
    weight-only with one scale per row (the head also offered int8 activations),
    from their de-quantized GGUF values. That is
    a second rounding, but at 8 bits of a 5-to-8-bit tensor; in bf16 these layers
    took half of the 1.5B's Linear time (the LM head alone 15 ms of about 60 per
    step, 7.4 in int8).

    Each replacement is checked first: the GGUF's de-quantized tensor must be the
    weight the model holds (in the model's dtype), so a name mapping or a row
    permutation the loader applied (Llama's q/k) can never swap in wrong weights;
    a tensor that does not match is left as it is and counted."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(gguf_path)
    modules = dict(model.named_modules())
    report = {"int4": 0, "int8": 0, "mismatched": 0}
    for tensor in reader.tensors:
        name = module_name(tensor.name)
        module = modules.get(name) if name else None
        if not isinstance(module, nn.Linear):
            continue
        cols, rows = (int(n) for n in tensor.shape[:2])  # GGUF lists the fastest dimension first
        weight = module.weight
        gguf_weight = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).reshape(rows, cols))
        if weight.shape != (rows, cols) or not torch.equal(gguf_weight.to(weight.dtype), weight.detach()):
            report["mismatched"] += 1
            continue
        parent_name, _, child = name.rpartition(".")
        parent = modules[parent_name] if parent_name else model
        bias = module.bias.detach() if module.bias is not None else None
        if tensor.tensor_type == GGMLQuantizationType.Q4_K:
            setattr(parent, child, Int4Linear.from_q4k(tensor.data, rows, cols, bias, int8_activations=any(
                name.endswith(f".{layer}") for layer in INT8_ACTIVATION_LAYERS)))
            report["int4"] += 1
        else:
            # The LM head's input is the final norm's output, with no outlier channels to
            # lose: it may run int8 activations (per row), where a kernel for them installs.
            # A down projection's input carries Qwen's outlier channels: only a kernel that
            # keeps about 14 bits of a row may serve it (on the 1.5B that kept top-1 agreement
            # with fp32 as it was, and the 5- and 8-row forwards 8% faster on an AVX2 EPYC).
            down = name.endswith(".mlp.down_proj")
            setattr(parent, child, Int8WeightOnlyLinear(
                gguf_weight, bias, int8_activations=name == "lm_head" or down, activation_bits=14 if down else 8,
                blocks=gguf_rows(tensor.data, rows), ggml_type=int(tensor.tensor_type)))
            report["int8"] += 1
    if report["int8"] and getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        # The LM head is its own int8 module now; the embedding keeps its rows.
        model.config.tie_word_embeddings = False
    return report


def quantize_cuda(model: nn.Module) -> nn.Module:
    """On CUDA: torchao's int4 weight-only kernel, group 32, every Linear but the LM head.

    torchao packs from the weights as loaded, so this is a second rounding of the
    Q4_K values (the CPU path carries the codes over instead); the LM head stays
    in the loaded dtype. Not exercised on this project's CPU machines."""
    from specdec.rpc.errors import FailedPrecondition
    try:
        from torchao.quantization import Int4WeightOnlyConfig, quantize_
    except ImportError as error:
        raise FailedPrecondition("--quantize int4 on cuda needs torchao: pip install torchao") from error
    head = model.get_output_embeddings()
    quantize_(model, Int4WeightOnlyConfig(group_size=GROUP),
              filter_fn=lambda module, _: isinstance(module, nn.Linear) and module is not head)
    return model


log = logging.getLogger(__name__)


def _apply(model: nn.Module, ctx: QuantizeContext) -> nn.Module:
    if ctx.device.type == "cuda":
        return quantize_cuda(model)
    report = quantize_from_gguf(model, str(ctx.gguf))
    log.info("%s: int4 from Q4_K blocks on %d Linear layers; %d in int8 (other GGUF types), "
             "%d did not match their GGUF tensor and were kept", ctx.name, report["int4"], report["int8"],
             report["mismatched"])
    return model


register(Quantization("int4", _apply, lambda dtype, device: f"{dtype}+int4", needs_gguf=True), fusable=[Int4Linear])
