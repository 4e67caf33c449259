"""The model pairs `specdec up`, `bench` and `load` know by name. Plain data, no
torch: the client side of the CLI reads it without loading a framework."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Pair:
    draft: str
    target: str
    draft_quantize: str = "none"
    draft_dtype: str = "fp32"
    target_dtype: str = "fp32"
    draft_head_vocab: int = 0   # draft LM head restricted to this many ids (0 = all)
    target_quantize: str = "none"
    target_from: str = ""       # a target the registry does not ship (too large for its packages): its hub id


PAIRS: dict[str, Pair] = {
    # The default: the 0.5B draft in Q4_0 on llama.cpp's kernels (INT8 where the llama-cpp
    # extra is missing, or on a GPU: specdec_tools.launcher) ahead of the 1.5B target in int4
    # from its own Q4_K blocks (bf16 elsewhere; `--target-quantize none` for bf16 throughout).
    # The draft's head keeps the 32,768 ids the target writes most: on the AVX-512 EPYC
    # its step is 9% shorter for 1% less expected acceptance (docs/kernels.md).
    "qwen-coder": Pair(draft="qwen2.5-coder-0.5b-instruct", target="qwen2.5-coder-1.5b-instruct",
                       draft_quantize="q4_0", target_dtype="bf16", target_quantize="int4",
                       draft_head_vocab=32768),
    # The GPU pair: on a GPU a 1.5B target's step is too short for a separate drafter to pay
    # over RPC; a 7B's (about 3.5 ms at the HBM limit) is not (docs/gpu.md). Its 15 GB are
    # the user's own directory (--target-model DIR); the draft is INT8 in bf16 (quant.int8_device).
    "qwen-coder-7b": Pair(draft="qwen2.5-coder-0.5b-instruct", target="qwen2.5-coder-7b-instruct",
                          draft_quantize="int8", draft_dtype="bf16", target_dtype="bf16", draft_head_vocab=32768,
                          target_from="Qwen/Qwen2.5-Coder-7B-Instruct"),
    # A quick real pair: SmolLM2 drafting for itself through INT8.
    "smollm2-self": Pair(draft="smollm2-135m-instruct", target="smollm2-135m-instruct", draft_quantize="int8"),
    "tiny": Pair(draft="tiny-draft", target="tiny-target"),
    "tiny-mismatch": Pair(draft="tiny-mismatch-draft", target="tiny-target"),
}
DEFAULT_PAIR = "qwen-coder"
