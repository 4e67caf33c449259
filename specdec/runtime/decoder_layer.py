"""One decoder layer of the Llama/Qwen2 family as the lean and paged forwards run it:
its modules (q/k/v and gate/up fused where their weights allow), the element-wise
arithmetic between them (rotary, RMSNorm), and the torch threads each part runs on.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from specdec.runtime.quant.base import fuse


@contextmanager
def op_threads(threads: int) -> Iterator[None]:
    """Within: torch's CPU ops on `threads` threads (0: unchanged).

    The attention of a decode or verify call is a dozen ops on a few KB; on two
    threads each waits to wake the other OpenMP worker. In a forward of 8 sessions'
    decode rows on the 1.5B target (2-core EPYC) the 224 per-sequence attentions took
    47 ms of 155 on two threads and 9 of 120 on one; at 1,000 cached tokens a session,
    58 against 62 ms. Set per call, it costs the omp_set_num_threads of each."""
    if not threads:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


LinearCall = Callable[[nn.Module, torch.Tensor], torch.Tensor]   # runs a linear layer (module, x) -> y


def direct(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module(x)


def on_threads(threads: int) -> LinearCall:
    """Runs a linear layer on `threads` torch threads."""
    def linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        with op_threads(threads):
            return module(x)
    return linear


class Layer:
    """One decoder layer's modules, with q/k/v and gate/up fused where their weights allow."""

    def __init__(self, layer: nn.Module):
        attn, mlp = layer.self_attn, layer.mlp
        self.input_norm, self.post_norm = layer.input_layernorm, layer.post_attention_layernorm
        self.o_proj = attn.o_proj
        projections = [attn.q_proj, attn.k_proj, attn.v_proj]
        self.qkv = fuse(projections)
        self.q_proj, self.k_proj, self.v_proj = projections
        self.q_size, self.kv_size = attn.q_proj.out_features, attn.k_proj.out_features
        gate_up = [getattr(mlp, "gate_proj", None), getattr(mlp, "up_proj", None)]
        self.gate_up = fuse(gate_up)
        self.mlp = mlp

    def project_qk_v(self, h: torch.Tensor, qk_heads: int, dim: int,
                     linear: LinearCall = direct) -> tuple[torch.Tensor, torch.Tensor]:
        """h [R, hidden] -> the queries' and keys' heads side by side [R, qk_heads, dim]
        (one rotary for both), and the values [R, kv_size]."""
        rows = h.shape[0]
        if self.qkv is None:
            q, k, v = linear(self.q_proj, h), linear(self.k_proj, h), linear(self.v_proj, h)
            return torch.cat([q, k], dim=-1).view(rows, qk_heads, dim), v
        qkv = linear(self.qkv, h)
        return qkv[:, :self.q_size + self.kv_size].view(rows, qk_heads, dim), qkv[:, self.q_size + self.kv_size:]

    def linears(self) -> list[nn.Module]:
        """The projections this layer's forward calls (a fused one, not its parts)."""
        qkv = [self.qkv] if self.qkv is not None else [self.q_proj, self.k_proj, self.v_proj]
        mlp = [self.gate_up, self.mlp.down_proj] if self.gate_up is not None else [self.mlp]
        return [*qkv, self.o_proj, *mlp]

    def feed_forward(self, h: torch.Tensor, linear: LinearCall = direct) -> torch.Tensor:
        if self.gate_up is None:
            return linear(self.mlp, h)
        gate, up = linear(self.gate_up, h).chunk(2, dim=-1)
        return linear(self.mlp.down_proj, self.mlp.act_fn(gate) * up)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin [R, dim] with its first half negated: rotate_half(x) * sin is then
    roll(x, dim / 2) * signed sin, exactly (a negation rounds nothing)."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [R, heads, dim] rotated at each row's position (cos, signed_sin [R, 1, dim]):
    x * cos + rotate_half(x) * sin, the arithmetic transformers' rotary does, in 4
    ops over the queries' and keys' heads together, where it takes 7 for each."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * signed_sin


def rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    # torch's fused kernel: one op where transformers' RMSNorm runs eight.
    return F.rms_norm(x, norm.weight.shape, norm.weight, norm.variance_epsilon)
