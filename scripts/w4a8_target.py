#!/usr/bin/env python
"""The int4 target with zentorch's int8 x int4 kernel (scripts/kernel_bench.py's
zentorch-w4a8: the GGUF's own Q4_K codes, activations quantized to int8 per row)
in place of torch's int4 kernel, side by side in one run: forward ms by rows
after a 200-token prefix, and top-1 agreement and KL against the fp32
de-quantized GGUF, teacher-forced on Spec-Bench dev prompts (as
scripts/quant_check.py). Its per-row activation scales make a row's output the
same whatever rows share the call, so one kernel could serve decode and
verification alike; the question is whether it is faster and faithful enough.
Modes: torch (the served kernel), w4a8 on every layer but the MLP down
projections (whose inputs carry Qwen's activation outliers), w4a8 everywhere;
and w8a8-but-down: those layers' de-quantized Q4_K weights rounded again to
int8 per output channel, through the per-row int8 x int8 backends
(specdec.runtime.kernels, each checked on the layer as the services check it).

  python scripts/w4a8_target.py --prompts 4 --rows 1,2,4,5,8,16
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys


import torch

from specdec.runtime import kernels, torch_thread
from specdec.runtime.models import load_model
from specdec.runtime.quant.int4 import Int4Linear

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from kernel_bench import call_zentorch_w4a8, w4a8_state  # noqa: E402
from quant_check import agreement, forward_ms, logits, teacher_forced  # noqa: E402

MODES = ("torch", "w4a8-but-down", "w4a8", "w8a8-but-down")


def use(loaded, mode: str) -> None:
    """Every Int4Linear the forward calls (the lean forward's fused ones too) on torch's kernel or on w4a8."""
    for module in {id(m): m for m in [*loaded.model.modules(), *loaded.lean.linears()]}.values():
        if not isinstance(module, Int4Linear):
            continue
        module.__dict__.pop("_kernel", None)
        down = module.in_features > module.out_features   # the MLP down projection (K = intermediate)
        if mode == "torch" or (mode.endswith("-but-down") and down):
            continue
        if mode == "w8a8-but-down":
            if "_w8a8" not in module.__dict__:
                weight = module.dense_weight().float()
                scales = weight.abs().amax(dim=1).clamp(min=1e-8) / 127.0
                codes = torch.round(weight / scales[:, None]).to(torch.int8)
                torch_int4 = lambda x, m=module: m._int4(x.to(m.dtype))  # noqa: E731
                accel = kernels.prepared("int8-channel", (codes, scales), torch_int4, per_row=True)
                module.__dict__["_w8a8"] = accel[0] if accel else None
            if module.__dict__["_w8a8"] is not None:
                backend, state = module.__dict__["_w8a8"]
                module.__dict__["_kernel"] = lambda x, b=backend, s=state: b.run(s, x).to(x.dtype)
            continue
        if "_w4a8" not in module.__dict__:
            scale, zero = (t.t().float() for t in module.scales_and_zeros.unbind(-1))   # [N, K/32]
            module.__dict__["_w4a8"] = w4a8_state(module.codes(), scale, 8 * scale - zero)
        module.__dict__["_kernel"] = lambda x, m=module: call_zentorch_w4a8(m.__dict__["_w4a8"], x)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new", type=int, default=48)
    parser.add_argument("--rows", default="1,2,4,5,8,16")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of timings, every mode in each")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="w4a8_target.json")
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    if "avx512_vnni" not in kernels.cpu_flags():   # zentorch's int8 GEMMs die of SIGILL without it
        parser.error("this CPU lacks AVX-512 VNNI, which zentorch's int8 kernels need")
    torch_thread.set_threads(args.threads)
    reference = load_model(args.model, dtype="fp32")
    texts = teacher_forced(reference, args.prompts, args.new)
    ref_logits = [logits(reference, ids, start) for start, ids in texts]
    del reference
    served = load_model(args.model, dtype="bf16", quantize="int4")
    prefix = (texts[0][1] * 4)[:200]
    results = {mode: {"ms": {r: [] for r in rows}} for mode in MODES}
    for mode in MODES:
        use(served, mode)
        top1, kl = agreement(served, texts, ref_logits)
        results[mode].update(top1_vs_fp32=top1, kl_vs_fp32=kl)
    for _ in range(args.rounds):   # interleaved: the machine's drift is not read as a difference
        for mode in MODES:
            use(served, mode)
            for r in rows:
                results[mode]["ms"][r].append(forward_ms(served, prefix, r, repeats=3))
    print(f"{args.model}, {args.threads} threads; ms by rows (median of {args.rounds} rounds); quality "
          f"teacher-forced on {args.prompts} dev prompts x {args.new} tokens\n")
    print("| kernel | " + " | ".join(f"{r} rows" for r in rows) + " | top-1 vs fp32 | KL vs fp32 |")
    print("|---|" + "---|" * len(rows) + "---|---|")
    for mode, r in results.items():
        r["ms"] = {k: statistics.median(v) for k, v in r["ms"].items()}
        print(f"| {mode} | " + " | ".join(f"{r['ms'][k]:.1f}" for k in rows)
              + f" | {r['top1_vs_fp32']:.4f} | {r['kl_vs_fp32']:.4f} |")
    pathlib.Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(torch_thread.run(main))
