"""INT8 off the CPU (a GPU's draft): weight-only int8, as gpt-fast's int8 path.

Every projection keeps its weight as int8 codes with one scale per output channel
and computes in the model's dtype (bf16 on a GPU): y = (x @ codes^T) * scales.
Activations are never quantized, so Qwen's outlier channels (the down
projections' inputs, which the CPU path keeps weight-only for) need no rule of
their own, and one row's output never depends on another's.

What makes it INT8 on the device is the compiler: under `torch.compile` with
coordinate-descent tuning (gpt-fast's setting, which the static step's compile
takes: specdec.runtime.paged_step, PagedRunner(compile=...)) a 1-row matmul, a
draft step's, is a reduction whose loads the cast of the codes folds into (one
kernel reading one byte a weight; gpt-fast measured it near the HBM limit).
A call of more rows, and any call eager, runs the cast as a kernel of its own
that writes the weight out in bf16 first: slower than bf16 weights, and the GPU
check's step tables say by how much.

(torch's int8 x int8 `_int_mm` needs more than 16 rows, more than any decode or
verify call, and quantizing activations per row is what the outliers forbid.)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Int8DeviceLinear(nn.Module):
    """y = (x @ codes^T) * scales + bias, codes int8 [out, in], scales and bias in the compute dtype."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        assert codes.dtype == torch.int8 and codes.shape[0] == scales.shape[0], (codes.dtype, codes.shape, scales.shape)
        self.out_features, self.in_features = codes.shape
        self.register_buffer("codes", codes, persistent=False)
        self.register_buffer("scales", scales, persistent=False)
        self.register_buffer("bias", bias, persistent=False)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> "Int8DeviceLinear":
        """Per output channel: its largest magnitude at 127 (the CPU path's rounding, quant.int8)."""
        from specdec.runtime.quant.int8 import per_row_int8
        codes, scales = per_row_int8(weight)
        return cls(codes.to(weight.device), scales.to(weight.device, dtype),
                   None if bias is None else bias.detach().to(dtype))

    @classmethod
    def from_linear(cls, linear: nn.Linear, dtype: torch.dtype) -> "Int8DeviceLinear":
        return cls.from_weight(linear.weight, linear.bias, dtype)

    def dense_weight(self) -> torch.Tensor:
        """[out, in] in the compute dtype: what the layer multiplies by."""
        return self.codes.to(self.scales.dtype) * self.scales[:, None]

    @staticmethod
    def concatenable(parts) -> bool:
        return len(parts) > 1 and all(type(p) is Int8DeviceLinear for p in parts) \
            and len({p.in_features for p in parts}) == 1 and len({p.scales.dtype for p in parts}) == 1

    @classmethod
    def concat(cls, parts) -> "Int8DeviceLinear":
        """One layer computing the parts side by side (q/k/v, gate/up): one matmul where there
        were several. The parts' buffers become views of the fused ones (no weight held twice),
        so each part still computes on its own what it did."""
        assert cls.concatenable(parts), [type(p).__name__ for p in parts]
        biased = any(p.bias is not None for p in parts)
        fused = cls(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]),
                    torch.cat([p.bias if p.bias is not None else p.scales.new_zeros(p.out_features)
                               for p in parts]) if biased else None)
        start = 0
        for p in parts:
            end = start + p.out_features
            p.codes, p.scales = fused.codes[start:end], fused.scales[start:end]
            if p.bias is not None:
                p.bias = fused.bias[start:end]
            start = end
        return fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The cast is the de-quantization: inside a compiled step it is the matmul's load.
        out = F.linear(x, self.codes.to(x.dtype)) * self.scales.to(x.dtype)
        return out if self.bias is None else out + self.bias.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weight-only"


def quantize_model(model: nn.Module, head: nn.Module | None, keep_ids: torch.Tensor | None) -> nn.Module:
    """Every nn.Linear of `model` (on its device, in its dtype) to Int8DeviceLinear, in place; the LM
    `head` restricted to `keep_ids` where given (quant.int8.Int8RestrictedHead)."""
    from specdec.runtime.quant.int8 import Int8RestrictedHead
    dtype = next(model.parameters()).dtype
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and child is not head:
                setattr(parent, name, Int8DeviceLinear.from_linear(child, dtype))
    if head is not None:
        weight = head.weight.detach()
        if keep_ids is not None:
            keep_ids = keep_ids.to(weight.device)
            new_head = Int8RestrictedHead(weight, keep_ids, weight.shape[0],
                                          head=Int8DeviceLinear.from_weight(weight[keep_ids], None, dtype))
        else:
            new_head = Int8DeviceLinear.from_linear(head, dtype)
        model.config.tie_word_embeddings = False   # the input embedding keeps its rows (a lookup, not a GEMM)
        model.set_output_embeddings(new_head)
    return model
