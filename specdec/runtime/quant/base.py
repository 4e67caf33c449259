"""The interface every quantized layer kind sits behind, and the registry each
quantization module adds itself to (specdec.runtime.quant names them)."""
from __future__ import annotations

import pathlib
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch
from torch import nn


@dataclass(frozen=True)
class QuantizeContext:
    """What a quantization may need besides the model."""
    name: str                          # the model's name (registry name or path)
    device: torch.device
    head_vocab: int = 0                # a draft head cut to the N most frequent ids (0: the whole vocabulary)
    vocab_ranking: object = None       # [n] ids, most frequent first (specdec.weights.vocab_rank); None: by id
    special_ids: Sequence[int] = ()    # ids a cut head always keeps (special, added, EOS)
    gguf: pathlib.Path | None = None   # the GGUF file the weights came from, if any


@dataclass(frozen=True)
class Quantization:
    name: str                                                    # --quantize NAME
    apply: Callable[[nn.Module, QuantizeContext], nn.Module]     # the model, quantized (in place or anew)
    dtype_label: Callable[[str, torch.device], str]              # the loaded dtype (on that device) as Info reports it
    needs_gguf: bool = False                                     # built from the GGUF's own blocks
    uses_head_vocab: bool = False                                # --head-vocab means something to it


class Fusable(Protocol):
    """A Linear kind that computes several of its own side by side as one layer."""
    @classmethod
    def concatenable(cls, layers: Sequence[nn.Module]) -> bool: ...
    @classmethod
    def concat(cls, layers: Sequence[nn.Module]) -> nn.Module: ...


QUANTIZATIONS: dict[str, Quantization] = {}
FUSABLE: list[type] = []


def register(quantization: Quantization, fusable: Sequence[type] = ()) -> Quantization:
    QUANTIZATIONS[quantization.name] = quantization
    FUSABLE.extend(fusable)
    return quantization


def fuse(layers: Sequence[nn.Module]) -> nn.Module | None:
    """One layer computing `layers` side by side, where their kind can; else None.
    (A layer's kind registered itself when its module made it.)"""
    for kind in FUSABLE:
        if kind.concatenable(layers):
            return kind.concat(layers)
    return None
