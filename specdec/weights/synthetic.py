"""Models of a real shape with random weights, for timing where weights cannot travel.

Step time does not depend on the weights' values, and a GPU machine with no
network cannot pull 15 GB of them: a benchmark builds each model from its
config.json alone, its weights drawn from a seed straight on the device in the
dtype it will serve in (seconds for a 7B where writing and reading its
safetensors would take minutes). What such a model writes is noise, so its
acceptance against a draft says nothing: benchmarks pair it with the
verifier's --synthetic-acceptance. Never a default: the flag that asks for it
says BENCHMARK ONLY, and the service logs it at start.
"""
from __future__ import annotations

import json
import logging
import pathlib

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

log = logging.getLogger(__name__)


def build(config_dir: pathlib.Path, seed: int, dtype: torch.dtype, device: torch.device) -> PreTrainedModel:
    """The model of `config_dir`'s config.json with every weight drawn from `seed`:
    transformers' own initialization (normal at the config's initializer_range,
    norms at one), run on `device` so the weights are made where they serve."""
    config = AutoConfig.from_pretrained(config_dir, local_files_only=True)
    cuda = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda), torch.device(device):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    parameters = sum(p.numel() for p in model.parameters())
    log.warning("BENCHMARK MODEL: %s built from its config with random weights (seed %d, %.2fB parameters, %s, %s); "
                "its output is noise", config_dir, seed, parameters / 1e9, dtype, device)
    return model.eval()


def write_model_dir(out: pathlib.Path, config: dict, tokenizer_dir: pathlib.Path) -> pathlib.Path:
    """A directory `build` and the tokenizer loader read: config.json, and a copy
    of the tokenizer's files (every model of a pair shares one tokenizer)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for file in tokenizer_dir.iterdir():
        if file.is_file() and file.name != "config.json":
            (out / file.name).write_bytes(file.read_bytes())
    return out
