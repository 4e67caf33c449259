"""Quantized layers behind one interface (specdec.runtime.quant.base). A
quantization is one module in this package that calls `base.register(...)`,
and its name in METHODS: the loader applies it by name without knowing what it
does, and the lean forward fuses layers (q/k/v, gate/up) through `base.fuse`
without knowing their kind. The names need no torch, so command lines (and
`specdec up`) offer them from a process that never loads a model."""
from __future__ import annotations

import importlib

METHODS = ("int4", "int8", "q4_0")   # --quantize NAME: the module specdec.runtime.quant.NAME
QUANTIZE = ("none", *METHODS)    # what --quantize accepts


def quantizations() -> dict:
    """name -> base.Quantization, every module of METHODS imported (and so registered)."""
    for name in METHODS:
        importlib.import_module(f"{__name__}.{name}")
    from specdec.runtime.quant.base import QUANTIZATIONS
    return QUANTIZATIONS
