"""Quantized models converted once and kept in the model cache.

Building the int4 target from its GGUF reads and de-quantizes every tensor (about
30 s and a 10.8 GB peak for the 1.5B); the INT8 draft passes through an fp32 copy
of the 0.5B. Both are deterministic functions of the file and the settings, so
the first start saves the finished module next to the model, and later starts
load it memory-mapped: no de-quantization and no fp32 copy.

The saved form is the module itself (torch.save), because its packed weights
(torch's int4 CPU packing, fbgemm's int8 packed params) are laid out for the
torch that made them: the entry's key names the torch and transformers versions
and a format number, so an upgrade converts again instead of loading a stale
layout. The files are written by this service into its own cache directory,
atomically, and loaded only from there.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
import time
import warnings

import torch
import transformers
from filelock import FileLock
from torch import nn

log = logging.getLogger(__name__)

# Part of every entry's key. The saved module names its classes by import path:
# raised whenever a quantized layer's class or module moves, or its saved state changes.
FORMAT = 7
FILE = "module.pt"


def _key(settings: dict[str, object]) -> dict[str, object]:
    """What an entry's weights depend on: the settings, and the libraries that laid them out."""
    return {**settings, "format": FORMAT, "torch": torch.__version__, "transformers": transformers.__version__}


def entry_dir(model_dir: pathlib.Path, settings: dict[str, object]) -> pathlib.Path:
    """The cache entry for a model directory and the settings that shaped its weights."""
    digest = hashlib.sha256(json.dumps(_key(settings), sort_keys=True).encode()).hexdigest()[:16]
    return model_dir / "converted" / f"{settings.get('quantize', 'model')}-{digest}"


def load(entry: pathlib.Path) -> nn.Module | None:
    """The saved module of `entry`, or None if there is none (yet)."""
    path = entry / FILE
    if not path.is_file():
        return None
    started = time.perf_counter()
    # weights_only=False: the file is a module this service wrote (see the module docstring).
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="TypedStorage is deprecated")  # torch's own unpickling
            module = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except Exception as error:  # a damaged entry costs a conversion, not the start
        log.warning("could not load the converted model from %s (%s); converting again", entry, error)
        path.unlink(missing_ok=True)
        return None
    log.info("loaded the converted model from %s in %.1f s", entry, time.perf_counter() - started)
    return module


def save(module: nn.Module, entry: pathlib.Path, settings: dict[str, object]) -> None:
    """Save `module` into `entry`, atomically, unless another process got there first."""
    entry.mkdir(parents=True, exist_ok=True)
    with FileLock(str(entry / ".lock")):
        if (entry / FILE).is_file():
            return
        partial = entry / f"{FILE}.{os.getpid()}.partial"
        torch.save(module, partial)
        partial.replace(entry / FILE)
        (entry / "settings.json").write_text(json.dumps(_key(settings), indent=2))
    log.info("saved the converted model to %s", entry)
