"""One model's step costs, in process, as the services run it (the lean forward
over a session's KV cache), every timing closed by a synchronize:

  - ms of one forward by rows (a decode step is 1 row, verifying γ drafts γ + 1),
    after a 128-token prefix, the least of a few: the curve the services publish;
  - prefill ms per token over a 512-token prompt;
  - of one 1-row step: kernel launches and GPU-busy time against wall time
    (torch.profiler; on the CPU, the torch ops it ran);
  - the peak GPU memory with the model loaded and stepped.
"""
from __future__ import annotations

import gc
import math
import time
from dataclasses import asdict, dataclass, field

import torch

from specdec.runtime import torch_thread
from specdec.runtime.sequence import SequenceCache, drive
from specdec.runtime.models import LoadedModel, load_model
from specdec.service.warm_up import CURVE_PREFIX, measure_cost_curve

ROWS = (1, 2, 3, 4, 5, 8, 9, 16, 17)
PREFILL_TOKENS = 512


@dataclass
class StepTimes:
    label: str
    model: str
    dtype: str
    quantize: str
    parameters_b: float
    load_s: float = 0.0
    rows_ms: dict[int, float] = field(default_factory=dict)
    prefill_ms_per_token: float = 0.0
    launches: int = 0           # CUDA kernels (on the CPU: torch ops) of one 1-row step
    busy_ms: float = 0.0        # GPU time inside those kernels (0 on the CPU)
    wall_ms: float = 0.0        # the same step's wall time, synchronized
    peak_mb: float = 0.0
    note: str = ""

    def row(self) -> dict:
        return asdict(self)


def _ids(loaded: LoadedModel, count: int) -> list[int]:
    return [(7 * i + 3) % loaded.vocab_size for i in range(count)]


def rows_curve(loaded: LoadedModel, rows=ROWS, repeats: int = 5) -> dict[int, float]:
    """ms of one forward over n new rows after a 128-token prefix: the cost curve the
    services publish (warm_up.measure_cost_curve, synchronized on a GPU), at `rows`."""
    curve = measure_cost_curve(loaded, max(rows), repeats).forward_ms
    return {n: curve[n - 1] for n in rows}


def prefill_per_token(loaded: LoadedModel, tokens: int = PREFILL_TOKENS, repeats: int = 2) -> float:
    clock = loaded.policy.clock()
    ids = _ids(loaded, tokens + 1)
    best = float("inf")
    for _ in range(repeats):
        seq = SequenceCache(loaded, ids)
        started = clock()
        drive(seq.prefill_steps(chunk=tokens))  # one forward over the 512 tokens
        best = min(best, (clock() - started) * 1e3 / tokens)
    return round(best, 4)


def profile_step(loaded: LoadedModel) -> tuple[int, float, float]:
    """(launches, busy ms, wall ms) of one 1-row step after a CURVE_PREFIX-token prefix,
    profiled on the torch thread, where the forward's ops run."""
    return torch_thread.run(_profile_step, loaded)


def _profile_step(loaded: LoadedModel) -> tuple[int, float, float]:
    from torch.profiler import ProfilerActivity, profile
    clock = loaded.policy.clock()
    cuda = loaded.device.type == "cuda"
    ids = _ids(loaded, CURVE_PREFIX + 1)
    seq = SequenceCache(loaded, ids[:CURVE_PREFIX])
    seq.prefill()
    seq.forward([], keep_last=1)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        started = clock()
        seq.forward([ids[CURVE_PREFIX]], keep_last=1)
        wall = (clock() - started) * 1e3
    events = prof.events()
    if cuda:
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        busy = sum(e.time_range.elapsed_us() for e in kernels) / 1e3
        return len(kernels), round(busy, 3), round(wall, 3)
    ops = [e for e in events if e.name.startswith("aten::") and e.cpu_parent is None]
    return len(ops), 0.0, round(wall, 3)


def measure(label: str, path: str, parameters_b: float, *, device: str, dtype: str, quantize: str = "none",
            head_vocab: int = 0, seed: int = 0, rows=ROWS, repeats: int = 5) -> StepTimes:
    """Load (build) one model and take its step costs; the model is freed after."""
    out = StepTimes(label, path, dtype, quantize, float(f"{parameters_b:.3g}"))
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    loaded = load_model(path, dtype=dtype, device=device, quantize=quantize, head_vocab=head_vocab,
                        random_weights=seed)
    out.load_s = round(time.perf_counter() - started, 1)
    try:
        if loaded.lean is None:
            out.note = "transformers' forward (the lean forward does not cover this model)"
        out.rows_ms = rows_curve(loaded, rows, repeats)
        out.prefill_ms_per_token = prefill_per_token(loaded)
        out.launches, out.busy_ms, out.wall_ms = profile_step(loaded)
        if cuda:
            out.peak_mb = round(torch.cuda.max_memory_allocated() / 2**20, 0)
    finally:
        del loaded
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return out


def sdpa_backends(device: str, heads: int, kv_heads: int, head_dim: int, dtype=torch.bfloat16) -> dict[str, str]:
    """Which kernel scaled_dot_product_attention ran for the lean forward's two uses:
    a verification's few rows under a mask, and a prefill's causal block (read off
    the profiler's kernel names)."""
    from torch.profiler import ProfilerActivity, profile
    if not device.startswith("cuda"):
        return {"verify (masked)": "cpu", "prefill (causal)": "cpu"}
    F = torch.nn.functional
    found = {}
    for case, rows, length, masked in (("verify (masked)", 5, CURVE_PREFIX + 5, True),
                                       ("prefill (causal)", PREFILL_TOKENS, PREFILL_TOKENS, False)):
        q = torch.randn(1, heads, rows, head_dim, device=device, dtype=dtype)
        k, v = (torch.randn(1, kv_heads, length, head_dim, device=device, dtype=dtype) for _ in range(2))
        mask = torch.ones(rows, length, device=device, dtype=torch.bool).tril(length - rows) if masked else None
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=not masked, enable_gqa=True)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=not masked, enable_gqa=True)
            torch.cuda.synchronize()
        names = " ".join(e.name.lower() for e in prof.events()
                         if e.device_type == torch.autograd.DeviceType.CUDA)
        found[case] = ("flash" if "flash" in names else "cudnn" if "cudnn" in names else
                       "efficient" if ("fmha" in names or "efficient" in names) else "math")
    return found


def row_consistency(loaded: LoadedModel, tokens: int = 16) -> dict:
    """Whether a verification's rows give a decode step's argmax: `tokens` greedy
    decode steps of one row, then the same tokens verified in one forward of
    tokens + 1 rows. In fp32 on the CPU they agree bit for bit; in bf16 on a GPU
    1-row and k-row kernels sum in other orders, so an argmax may flip, and must
    then be a tie: the two tokens' logits within two bf16 steps of each other."""
    ids = _ids(loaded, CURVE_PREFIX)
    decode = SequenceCache(loaded, ids)
    decode.prefill()
    steps, rows = [], []
    for _ in range(tokens + 1):
        logits = decode.forward([], keep_last=1)[0][:loaded.vocab_size]
        rows.append(logits)
        token = int(logits.argmax())
        steps.append(token)
        decode.append([token])
    verify = SequenceCache(loaded, ids)
    verify.prefill()
    verified = verify.forward(steps[:tokens], keep_last=tokens + 1)[:, :loaded.vocab_size]
    differ, widest = 0, 0.0
    for i in range(tokens + 1):
        mine = int(verified[i].argmax())
        if mine == steps[i]:
            continue
        differ += 1
        widest = max(widest, bf16_steps_apart(float(rows[i][steps[i]]), float(rows[i][mine])))
    return {"positions": tokens + 1, "differ": differ, "widest_bf16_steps": round(widest, 2),
            "ties_only": widest <= 2.0}


def bf16_steps_apart(a: float, b: float) -> float:
    """|a - b| in bf16 steps at their magnitude (8 significant bits): two logits within two
    of them are a tie that 1-row and k-row kernels may break either way."""
    return abs(a - b) / 2.0 ** (math.floor(math.log2(max(abs(a), abs(b), 1e-30))) - 7)
