"""The names a model is loaded by that need no torch: what command lines offer
(specdec.service.settings) and the loader checks (specdec.runtime.models)."""
from __future__ import annotations

# specdec's lean forward over a static KV cache per session; the same arithmetic as a static step
# over one KV arena (CUDA graphs a row bucket on a GPU); or transformers'.
FORWARDS = ("lean", "paged", "hf")
DTYPES = ("fp32", "bf16", "fp16")
# torch.compile backends for the paged forward's static step (off: eager, graphs replayed as they are).
COMPILE = ("off", "inductor", "aot_eager")
PREFILL_WEIGHTS = ("dense", "unpack")  # a prefill's many rows: kept bf16 weights, or each layer unpacked per call
