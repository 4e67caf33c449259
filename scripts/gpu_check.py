#!/usr/bin/env python
"""The GPU path's checks in one run, one table (scripts/gpu_check.sh runs this):

  1. the device found;
  2. the tiny pair through the real services (`specdec up` as a subprocess stack)
     on --device: greedy speculative output equal to target-only on 3 prompts;
  3. the qwen-coder pair the same (bf16 target, INT8 draft on CUDA; on the CPU the
     pair's own int4 target), skipped with --quick. bf16 logits are not the same
     over 1 row and k rows (other kernels, other sums), so an output may leave
     target-only's where two tokens tie within bf16's rounding: the check then
     loads the target here and requires that tie at the first difference (the
     two tokens within two bf16 steps of each other), else it fails;
  4. 2,000 sampled runs of the tiny pair: the first two tokens against the
     target's exact distribution (chi-square, p > 1e-3);
  5. a 4-prompt `specdec bench` of spec-auto against target-only on qwen-coder
     (tok/s, acceptance, time to first token), skipped with --quick.

Every check runs whatever the others did; a failure prints its traceback under
the table. Installs nothing. Exit status 1 if any check failed.

  python scripts/gpu_check.py --device cuda
  python scripts/gpu_check.py --device cpu --quick     # what CI runs
"""
from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import math
import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

CHI_PROMPT, CHI_RUNS = "Hello, world! How are", 2000


def device_found(device: str) -> str:
    import torch
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda, but torch sees no CUDA device")
        return f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}"
    return f"no CUDA device: the checks run with --device cpu (torch {torch.__version__})"


def stack(pair: str, device: str):
    from specdec.weights.pairs import PAIRS
    from specdec_tools import launcher
    options = launcher.StackOptions.for_pair(PAIRS[pair], port=0, device=device, gamma="4")
    launcher.pull_models([options.draft_model, options.target_model])
    return launcher.Stack(options)


def greedy_equal(pair: str, device: str) -> str:
    from specdec_tools.checks import GREEDY_PROMPTS, greedy_runs
    running = stack(pair, device)
    try:
        drafted, differing = greedy_runs(running.launch().address)
    finally:
        running.stop()
    n = len(GREEDY_PROMPTS)
    identical = f"{n - len(differing)}/{n} prompts identical, {drafted} tokens drafted"
    if not differing:
        return identical
    from specdec.runtime.models import load_model
    options = running.options
    if options.target_dtype == "fp32":  # exact arithmetic: any difference is a bug
        prompt, spec, target = differing[0]
        raise AssertionError(f"greedy output differs from target-only on {prompt!r}: {spec} vs {target}")
    loaded = load_model(options.target_model, dtype=options.target_dtype, quantize=options.target_quantize, device=device)
    return identical + "; " + "; ".join(bf16_tie(loaded, *d) for d in differing)


def bf16_tie(loaded, prompt: str, spec: list[int], target: list[int]) -> str:
    """Where the outputs part, the target's own logits (one row, as a decode step)
    must hold both tokens within two bf16 steps of each other: a tie that the
    rounding of another row count decides either way. Anything wider fails."""
    from specdec.runtime.kv_cache import SequenceCache
    at = next(i for i, (a, b) in enumerate(zip(spec, target)) if a != b)
    ids = loaded.tokenizer.encode(prompt, add_special_tokens=False) + target[:at]
    seq = SequenceCache(loaded, ids)
    seq.prefill()
    logits = seq.forward([], keep_last=1)[0]
    a, b = float(logits[spec[at]]), float(logits[target[at]])
    step = 2.0 ** (math.floor(math.log2(max(abs(a), abs(b), 1e-30))) - 7)  # bf16: 8 significant bits
    if abs(a - b) > 2 * step:
        raise AssertionError(f"greedy output differs from target-only on {prompt!r} at token {at}, where the "
                             f"target's logits are {a:.3f} ({spec[at]}) and {b:.3f} ({target[at]}): no bf16 tie; "
                             f"{spec} vs {target}")
    return (f"{prompt!r} parts at token {at} on a bf16 tie (logits {a:.3f} and {b:.3f}, "
            f"{abs(a - b) / step:.0f} bf16 steps apart)")


def chi_square(device: str) -> str:
    from specdec.rpc.serving import channel
    from specdec.runtime.models import load_model
    from specdec.spec.sampling import SamplingConfig
    from specdec.v1 import coordinator_pb2_grpc
    from specdec_tools.checks import generate
    from specdec_tools.distribution import chi_square_p, exact_first_two_token_distribution, observed_outcome
    sampling = SamplingConfig(temperature=0.8, top_k=40)
    target = load_model("tiny-target", device=device)
    p1, joint = exact_first_two_token_distribution(target, target.tokenizer.encode(CHI_PROMPT), sampling)
    running = stack("tiny", device)
    try:
        with channel(running.launch().address) as ch:
            stub = coordinator_pb2_grpc.CoordinatorStub(ch)
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                responses = list(pool.map(lambda seed: generate(
                    stub, CHI_PROMPT, True, 3, temperature=0.8, top_k=40, seed=seed), range(CHI_RUNS)))
    finally:
        running.stop()
    first, pairs = collections.Counter(), collections.Counter()
    for r in responses:
        x1, pair = observed_outcome(r)
        first[x1] += 1
        pairs[pair] += 1
    p_first, p_pairs = chi_square_p(first, p1, CHI_RUNS), chi_square_p(pairs, joint, CHI_RUNS)
    accepted = sum(r.stats.accepted_tokens for r in responses) / max(1, sum(r.stats.draft_tokens for r in responses))
    if min(p_first, p_pairs) <= 1e-3:
        raise AssertionError(f"sampled output is not the target's: p = {p_first:.2g} (first), {p_pairs:.2g} (pairs)")
    return f"p = {p_first:.3f} (first token), {p_pairs:.3f} (pairs); acceptance {accepted:.2f}"


def bench(device: str) -> str:
    from specdec_tools.bench import running
    out = pathlib.Path(tempfile.mkdtemp(prefix="gpu_check_bench_"))
    argv = ["--pair", "qwen-coder", "--categories", "coding,writing,math_reasoning,translation", "--limit", "1",
            "--gammas", "", "--no-hf", "--no-bf16", "--no-model-only", "--temperatures", "0",
            "--max-new-tokens", "64", "--out", str(out)]
    if running.main(argv + ["--device", device]) != 0:
        raise RuntimeError("specdec bench failed")
    rows = {r["system"]: r for r in json.loads((out / "bench.json").read_text())["summary"] if r["category"] == "all"}
    auto, target = rows["spec-auto"], rows["target-only"]
    return (f"spec-auto {auto['tokens_per_second']:.2f} tok/s ({auto.get('speedup_vs_target_only', 0):.2f}x), "
            f"acceptance {auto.get('acceptance_rate', 0):.2f}, first token {auto.get('first_token_ms', 0):.0f} ms; "
            f"target-only {target['tokens_per_second']:.2f} tok/s, first token {target.get('first_token_ms', 0):.0f} ms; "
            f"greedy identical {auto.get('greedy_identical', '-')}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), required=True)
    parser.add_argument("--quick", action="store_true", help="the tiny pair's checks only")
    args = parser.parse_args()
    checks = [("device", lambda: device_found(args.device)),
              ("tiny pair, greedy = target-only", lambda: greedy_equal("tiny", args.device))]
    if not args.quick:
        checks.append(("qwen-coder pair, greedy = target-only", lambda: greedy_equal("qwen-coder", args.device)))
    checks.append((f"chi-square, {CHI_RUNS} sampled runs", lambda: chi_square(args.device)))
    if not args.quick:
        checks.append(("bench, 4 prompts: spec-auto vs target-only", lambda: bench(args.device)))
    from specdec_tools.checks import run_checks
    return run_checks("gpu_check", args.device, checks)


if __name__ == "__main__":
    sys.exit(main())
