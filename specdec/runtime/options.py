"""The names a model is loaded by that need no torch: what command lines offer
(specdec.service.settings) and the loader checks (specdec.runtime.models)."""
from __future__ import annotations

FORWARDS = ("lean", "hf")       # specdec's lean forward over a static KV cache, or transformers'
DTYPES = ("fp32", "bf16", "fp16")
PREFILL_WEIGHTS = ("dense", "unpack")  # a prefill's many rows: kept bf16 weights, or each layer unpacked per call
