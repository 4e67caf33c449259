"""INT8 for the draft model: cheap enough to pay, faithful enough to be accepted.

Per-tensor INT8 (`torch.ao` `quantize_dynamic`) made the Qwen 0.5B draft cheap
but cost it agreement with the target (0.77 against 0.93 in bf16). So:

* weights get one scale per output channel (per row), which keeps the small
  rows of a matrix from being rounded to a handful of levels;
* activations are quantized per row (dynamic, fbgemm's int8 GEMM on the CPU, one
  call a row, or a per-row kernel: a row's output never depends on its neighbours),
  except the MLP down projection's: its input, act(gate) * up, carries the
  massive outliers that a per-tensor activation scale cannot hold (measured on
  Qwen 0.5B: it alone took greedy agreement with the fp32 draft from 0.99 to
  0.87). It keeps bf16 activations against int8 weights. SmoothQuant-style
  migration (alpha 0.5 and 0.8) did not recover it;
* gate and up projections run as one GEMM;
* the LM head, a large share of a small model's cost (151,936 x 896 for Qwen
  0.5B), may be restricted to the `head_vocab` most frequent ids (by the
  tokenizer's ranking, specdec.weights.vocab_rank; by id without one) plus the special
  tokens. Byte-level BPE assigns ids in merge order, so low ids are the
  frequent tokens. The other ids get probability zero, which stays lossless:
  the drafter samples from, and sends, exactly this restricted distribution,
  and the rejection sampler corrects for it.

Off the CPU (a GPU) the same per-channel codes run weight-only in the model's
dtype, de-quantized inside the compiled step's matmuls (quant.int8_device).
"""
from __future__ import annotations

import dataclasses
import warnings

import torch
from torch import nn

from specdec.runtime import dense_rows, kernel_choices, kernels
from specdec.weights import vocab_rank
from specdec.runtime.quant import int8_device
from specdec.runtime.quant.base import Quantization, register

def _row_scales(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] fp32 -> [out]: one scale per output channel, its largest magnitude at 127."""
    return weight.abs().amax(dim=1).clamp(min=1e-8) / 127.0


def _pack(weight: torch.Tensor, bias: torch.Tensor | None):
    # weight: [out_features, in_features]
    weight = weight.detach().float()
    scales = _row_scales(weight)
    zero_points = torch.zeros(weight.shape[0], dtype=torch.long)
    with warnings.catch_warnings():
        # torch 2.13 flags quantized-tensor creation as deprecated; fbgemm's
        # per-channel dynamic GEMM still needs one to pack, and it is the
        # fastest int8 path on this CPU (about 1.6x `_weight_int8pack_mm`).
        warnings.simplefilter("ignore", UserWarning)
        qweight = torch.quantize_per_channel(weight, scales.double(), zero_points, 0, torch.qint8)
    return torch.ops.quantized.linear_prepack(qweight, None if bias is None else bias.detach().float())


def per_row_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (int8 codes [out, in], fp32 scales [out]): one scale per output
    channel, its largest magnitude at 127."""
    weight = weight.detach().float()
    scales = _row_scales(weight)
    return torch.round(weight / scales[:, None]).to(torch.int8), scales


def _dequantized(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """codes [out, in] int8 times their per-row scales [out] -> [out, in] in the dense path's dtype
    (dense_rows.matmul_dtype), in cache-sized pieces."""
    scales = scales.float()[:, None]
    return dense_rows.unpack(codes.shape[0], codes.shape[1], dense_rows.matmul_dtype(),
                             lambda start, end: codes[start:end].float().mul_(scales[start:end]))


class Int8Linear(nn.Module):
    """y = x W^T + b with W in int8 (per-channel scales), x quantized per call."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self._packed = _pack(weight, bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Int8Linear":
        return cls(linear.weight, linear.bias)

    def _codes(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(int8 codes [out, in], per-row scales [out] fp32, fp32 bias or None), as packed."""
        qweight, bias = torch.ops.quantized.linear_unpack(self._packed)
        return qweight.int_repr(), qweight.q_per_channel_scales().float(), bias

    @staticmethod
    def _fused_already(parts: list) -> "Int8Linear | None":
        """The fused layer these parts already are, in order (a second lean forward over the model), or None."""
        views = [p.__dict__.get("_fused") for p in parts]
        if not all(views) or len({id(v[0]) for v in views}) != 1:
            return None
        ranges = [(start, end) for _, start, end in views]
        whole = ranges[0][0] == 0 and ranges[-1][1] == views[0][0].out_features
        return views[0][0] if whole and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])) else None

    @staticmethod
    def concatenable(parts: list) -> bool:
        """Whether `concat` can fuse these: Int8Linears sharing their input size, none of them a
        part of a fused layer already, or all of them the whole of one, in order."""
        if len(parts) < 2 or not all(type(p) is Int8Linear for p in parts):
            return False
        if Int8Linear._fused_already(parts) is not None:
            return True
        return all("_fused" not in p.__dict__ for p in parts) and len({p.in_features for p in parts}) == 1

    @classmethod
    def concat(cls, parts: list["Int8Linear"]) -> "Int8Linear":
        """One Int8Linear computing the parts' outputs side by side (q/k/v): one activation
        quantization and one GEMM call where there were three, with the parts' own codes
        and scales, so each output is what its part computed. A small model's step is
        mostly such calls (the 0.5B draft's k and v are 128 x 896). The parts then compute
        through it, a slice of its output, so no weight is held twice."""
        assert cls.concatenable(parts), [(type(p).__name__, p.in_features) for p in parts]
        if (fused := cls._fused_already(parts)) is not None:
            return fused
        codes, scales, biases = zip(*(p._codes() for p in parts))
        bias = None if all(b is None for b in biases) else torch.cat(
            [b if b is not None else torch.zeros(p.out_features) for b, p in zip(biases, parts)])
        fused = cls.__new__(cls)
        nn.Module.__init__(fused)
        fused.in_features, fused.out_features = parts[0].in_features, sum(p.out_features for p in parts)
        fused._packed = kernels.fbgemm_pack(torch.cat(codes), torch.cat(scales), bias)
        start = 0
        for p in parts:
            p.__dict__.pop("_accel", None)
            del p._packed
            p._fused = (fused, start, start + p.out_features)
            start += p.out_features
        return fused

    def dense_weight(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[out, in] (the int8 rows times their scales, in the dense path's dtype) and the fp32 bias."""
        codes, scales, bias = self._codes()
        return _dequantized(codes, scales), bias

    def _dense(self, flat: torch.Tensor) -> torch.Tensor:
        # A prefill's many rows: bf16 or fp32 activations against the de-quantized weight
        # (finer than the per-row int8 activations of the kernel, and faster there).
        weight, bias = dense_rows.weight(self, self.dense_weight)
        out = dense_rows.linear(flat, weight)
        return out if bias is None else out + bias

    def _accelerated(self) -> list[tuple[kernels.Backend, object]]:
        """The accelerated kernels for this layer's codes (specdec.runtime.kernels),
        prepared on its first call: none where no backend installs."""
        accel = self.__dict__.get("_accel")
        if accel is None:
            accel = []
            if kernels.usable("int8-channel"):
                codes, scales, bias = self._codes()
                without_bias = (lambda x: torch.ops.quantized.linear_dynamic(x, self._packed, kernels.reduce_range())
                                - (bias if bias is not None else 0))
                accel = kernels.prepared("int8-channel", (codes, scales), without_bias,
                                         key=("int8-dynamic", self.out_features, self.in_features))
                self._bias = bias
            self._accel = accel
        return accel

    def __getstate__(self):
        # Saved in the model cache: the accelerated kernels' weights are this machine's, made again on load.
        return {k: v for k, v in self.__dict__.items() if k not in ("_accel", "_bias", "_kept_dense")}

    def _by_row(self, flat: torch.Tensor) -> torch.Tensor:
        """fbgemm's dynamic GEMM, one call a row. It quantizes its activations on the range of
        the whole call, so a row computed beside others (other sessions' rows in a batched
        forward, a verification's) would depend on them; alone, each row keeps its own bits."""
        rows = [torch.ops.quantized.linear_dynamic(flat[i:i + 1], self._packed, kernels.reduce_range())
                for i in range(flat.shape[0])]
        return rows[0] if len(rows) == 1 else torch.cat(rows)

    def _kernel(self, flat: torch.Tensor) -> torch.Tensor:
        """Every row as it would come out alone, on one kernel for every call (`pick_per_layer`):
        a seeded sample's drafts do not depend on which sessions share its forwards. Batches
        of several sessions may take another (`kernel_choices.gathered`), unless --batch-invariant."""
        accel = self._accelerated()
        bias = self.__dict__.get("_bias")      # the accelerated kernels compute without it
        if bias is not None:
            accel = [(dataclasses.replace(b, run=lambda state, x, run=b.run: run(state, x) + bias), s)
                     for b, s in accel]
        return kernel_choices.pick_per_layer(("int8-dynamic", self.out_features, self.in_features), flat, "fbgemm-int8",
                                      self._by_row, accel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in_features] -> [..., out_features], in x's dtype
        if "_fused" in self.__dict__:   # a part of a fused layer (concat): its slice of the fused output
            fused, start, end = self._fused
            return fused(x)[..., start:end]
        flat = x.reshape(-1, self.in_features).float()
        out = dense_rows.run_rows(("int8-dynamic", self.out_features, self.in_features), flat,
                                  self._kernel, self._dense)
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel"


class Int8WeightOnlyLinear(nn.Module):
    """y = x W^T + b with W in int8 (per-channel scales) and x kept in bf16.

    For the layers whose inputs carry outliers a per-tensor activation scale
    cannot hold (Qwen's MLP down projections): weight-only int8 costs a little
    more per call than the dynamic int8 GEMM, but adds almost no error.

    int8_activations: also offer the kernels that compute these codes with int8
    activations scaled per row (specdec.runtime.kernels, `per_row`) and keep at least
    `activation_bits` of each row, for a layer whose kernel is slow: the int4 target's
    LM head (151,936 x 1,536), where torch's weight-only kernel took 16 of a 85 ms step
    on the AVX-512 EPYC and zentorch's int8 x int8 one 7 (38 against 6 for 4 rows), and
    its MLP down projections stored at 6 bits (their input carries Qwen's outlier
    channels: only a kernel keeping about 14 bits of a row serves them). One kernel then
    serves every call under dense_rows.MIN_ROWS, as timed on the first: a verification's
    logits must be the decode step's.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, int8_activations: bool = False,
                 activation_bits: int = 8, blocks: torch.Tensor | None = None, ggml_type: int = 0):
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        # The GGUF tensor's own bytes [N, bytes per row] and ggml type, where the weight came from
        # one: the kernels that take its blocks as they are (kernels' "gguf-blocks") read these.
        self.register_buffer("gguf_blocks", None if blocks is None else blocks.reshape(self.out_features, -1),
                             persistent=False)
        self.ggml_type = ggml_type
        codes, scales = per_row_int8(weight)
        self.register_buffer("qweight", codes, persistent=False)
        self.register_buffer("scales", scales.bfloat16(), persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().float(), persistent=False)
        self.int8_activations = int8_activations
        self.activation_bits = activation_bits

    def dense_weight(self) -> torch.Tensor:
        """[out, in]: the int8 rows times their scales, in the dense path's dtype."""
        return _dequantized(self.qweight, self.scales)

    def _weight_only(self, flat: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(flat.bfloat16(), self.qweight, self.scales)

    def _accelerated(self) -> list[tuple[kernels.Backend, object]]:
        """The per-row kernels that take the GGUF's blocks as they are, and with
        int8_activations those for this layer's codes, each checked against its own kernel
        on the first call; none where none installs."""
        accel = self.__dict__.get("_accel")
        if accel is None:
            accel = []
            key = ("int8-wo", self.out_features, self.in_features)
            if self.gguf_blocks is not None:
                accel += kernels.prepared("gguf-blocks", (self.gguf_blocks, self.ggml_type, self.in_features),
                                          self._weight_only, per_row=True, in_features=self.in_features, key=key)
            if self.int8_activations:
                accel += kernels.prepared("int8-channel", (self.qweight, self.scales.float()), self._weight_only,
                                          per_row=True, activation_bits=self.activation_bits, key=key)
            self._accel = accel
        return accel

    def __getstate__(self):
        # Saved in the model cache: the accelerated kernels' weights are this machine's, made again on load.
        return {k: v for k, v in self.__dict__.items() if k not in ("_accel", "_kept_dense")}

    def _dense(self, flat: torch.Tensor) -> torch.Tensor:
        return dense_rows.linear(flat, dense_rows.weight(self, self.dense_weight))

    def _kernel(self, flat: torch.Tensor) -> torch.Tensor:
        return kernel_choices.pick_per_layer(("int8-wo", self.out_features, self.in_features), flat, "torch-int8-wo",
                                      self._weight_only, self._accelerated())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in_features] -> [..., out_features], in x's dtype
        flat = x.reshape(-1, self.in_features).bfloat16()
        out = dense_rows.run_rows(("int8", self.out_features, self.in_features), flat, self._kernel, self._dense,
                                  kept=dense_rows.is_kept(self)).to(x.dtype)
        if self.bias is not None:
            out = out + self.bias.to(x.dtype)
        return out.reshape(*x.shape[:-1], self.out_features)


class Int8GatedMLP(nn.Module):
    """A Llama/Qwen-style gated MLP, down(act(gate(x)) * up(x)), in INT8.

    gate and up share their input, so they run as one GEMM (one activation
    quantization, one kernel call instead of two). The down projection's
    input, act(gate) * up, is where the massive activation outliers live, so
    it takes weight-only int8.
    """

    def __init__(self, mlp: nn.Module):
        super().__init__()
        self.intermediate = mlp.gate_proj.out_features
        self.gate_up = Int8Linear(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
                                  _cat_bias(mlp.gate_proj.bias, mlp.up_proj.bias))
        self.down = Int8WeightOnlyLinear(mlp.down_proj.weight, mlp.down_proj.bias)
        self.act_fn = mlp.act_fn

    @staticmethod
    def matches(module: nn.Module) -> bool:
        return all(isinstance(getattr(module, n, None), nn.Linear) for n in ("gate_proj", "up_proj", "down_proj")) \
            and hasattr(module, "act_fn")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).split(self.intermediate, dim=-1)
        return self.down(self.act_fn(gate) * up)


def _cat_bias(*biases: torch.Tensor | None) -> torch.Tensor | None:
    return None if all(b is None for b in biases) else torch.cat([b.detach().float() for b in biases])


class Int8RestrictedHead(nn.Module):
    """An LM head over a subset of ids; every other id gets logit -inf. Its layer over the
    kept rows is INT8 unless `head` gives another (a quantization's own, of weight[keep_ids])."""

    def __init__(self, weight: torch.Tensor, keep_ids: torch.Tensor, vocab_size: int, head: nn.Module | None = None):
        super().__init__()
        # keep_ids: [K] sorted ids the draft may propose; weight: [vocab_size, hidden]
        assert keep_ids.ndim == 1 and weight.shape[0] == vocab_size
        self.register_buffer("keep_ids", keep_ids.long(), persistent=False)
        self.vocab_size = vocab_size
        self.head = Int8Linear(weight[keep_ids]) if head is None else head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [..., hidden] -> logits [..., vocab_size]
        return self.scatter(self.head(hidden))

    def scatter(self, kept: torch.Tensor) -> torch.Tensor:
        """The kept ids' logits [..., K] -> [..., vocab_size], -inf at every other id (also
        for the ggml graph, which computes the head's rows itself)."""
        logits = torch.full((*kept.shape[:-1], self.vocab_size), float("-inf"), dtype=kept.dtype,
                            device=kept.device)
        return logits.index_copy_(-1, self.keep_ids, kept)

    def extra_repr(self) -> str:
        return f"{self.keep_ids.numel()} of {self.vocab_size} ids"


def head_keep_ids(vocab_size: int, head_vocab: int, always: list[int], ranking=None) -> torch.Tensor:
    """The `head_vocab` most frequent ids by `ranking` (by id where there is none)
    plus `always` (special and EOS ids), sorted."""
    return torch.tensor(vocab_rank.head_ids(vocab_size, head_vocab, always, ranking), dtype=torch.long)


def quantize_model(model: nn.Module, device: torch.device, *, head_vocab: int = 0,
                   special_ids: list[int] | None = None, ranking=None) -> nn.Module:
    """Quantize every nn.Linear of `model` in place to INT8; returns it (fp32 elsewhere).

    head_vocab > 0 also restricts the LM head to that many ids (plus special_ids).
    """
    head = model.get_output_embeddings()
    keep = None
    if head is not None and 0 < head_vocab < head.weight.shape[0]:
        keep = head_keep_ids(head.weight.shape[0], head_vocab, special_ids or [], ranking)
    if device.type != "cpu":
        return int8_device.quantize_model(model, head, keep)
    model = model.float()
    # Gated MLPs first, whole; then whatever nn.Linear is left (attention...).
    for kind in (Int8GatedMLP, Int8Linear):
        for parent in list(model.modules()):
            for child_name, child in list(parent.named_children()):
                if kind is Int8GatedMLP and Int8GatedMLP.matches(child):
                    setattr(parent, child_name, Int8GatedMLP(child))
                elif kind is Int8Linear and isinstance(child, nn.Linear) and child is not head:
                    setattr(parent, child_name, Int8Linear.from_linear(child))
    if head is not None:
        weight = head.weight.detach()
        if keep is not None:
            new_head = Int8RestrictedHead(weight, keep, weight.shape[0])
        else:
            new_head = Int8Linear(weight, getattr(head, "bias", None))
        # Untie: the input embedding keeps its fp32 rows (a lookup, not a GEMM).
        model.config.tie_word_embeddings = False
        model.set_output_embeddings(new_head)
    return model


register(Quantization(
    "int8", lambda model, ctx: quantize_model(model, ctx.device, head_vocab=ctx.head_vocab,
                                              special_ids=list(ctx.special_ids), ranking=ctx.vocab_ranking),
    lambda dtype, device: "fp32+int8" if device.type == "cpu" else f"{dtype}+int8", uses_head_vocab=True),
    fusable=[Int8Linear, int8_device.Int8DeviceLinear])
