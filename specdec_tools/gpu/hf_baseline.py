"""transformers' own decoding as a GPU user would run it, for the GPU check: the
same random weights (the seed the services build from), `generate()` greedy over
a static cache, its forward under torch.compile. transformers compiles it itself
on a GPU where a static cache is asked for (its CompileConfig: "reduce-overhead",
CUDA graphs); an older one without that is handed `torch.compile(model.forward,
mode="reduce-overhead")`, its documented recipe. Decode ms per token is the
difference of two generations (64 new tokens and 1) from one 128-token prompt
(the step curves' prefix), synchronized: what target-only through the services
is held against (the aim: within 1.2x). On the CPU it runs eager, to run at all.
"""
from __future__ import annotations

import gc
import pathlib
import time

import torch

from specdec.service.warm_up import CURVE_PREFIX
from specdec.weights import synthetic


def decode_ms_per_token(label: str, path: str, *, device: str, seed: int, new_tokens: int = 64,
                        compile: bool | None = None, repeats: int = 2) -> dict:
    torch_device = torch.device(device)
    compile = torch_device.type == "cuda" if compile is None else compile
    try:
        return {"label": label, "compiled": compile, **_timed(
            synthetic.build(pathlib.Path(path), seed, torch.bfloat16, torch_device), new_tokens, compile, repeats)}
    finally:   # the model is gone with _timed's frame: its memory back before the next section
        gc.collect()
        if torch_device.type == "cuda":
            torch.cuda.empty_cache()


def _timed(model, new_tokens: int, compile: bool, repeats: int) -> dict:
    device = model.device
    vocab = model.config.vocab_size
    ids = torch.tensor([[(7 * i + 3) % vocab for i in range(CURVE_PREFIX)]], device=device)
    if compile and not hasattr(model, "_valid_auto_compile_criteria"):   # no auto-compile in this transformers
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    pad = model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else 0

    def generate(tokens: int) -> float:
        # min_new_tokens: random weights may write EOS at any step; every run decodes `tokens`.
        started = time.perf_counter()
        model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                       cache_implementation="static", pad_token_id=pad)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - started
    began = time.perf_counter()
    generate(new_tokens), generate(1)        # compiles and captures every shape it meets
    warm_s = time.perf_counter() - began
    full = min(generate(new_tokens) for _ in range(repeats))
    one = min(generate(1) for _ in range(repeats))
    return {"warm_up_s": round(warm_s, 1), "decode_ms_per_token": round((full - one) / (new_tokens - 1) * 1e3, 3),
            "first_token_ms": round(one * 1e3, 2)}
