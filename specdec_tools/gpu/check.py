"""The GPU check: every section in turn within one time budget, one table.

  1. the machine: device, driver, torch, CUDA, which kernel SDPA runs for the
     lean forward's masked verify rows and causal prefill;
  2. the tiny pair (fp32) through the real services on the device: greedy
     speculative output equal to target-only; then 2,000 sampled runs of it
     against the target's exact distribution (chi-square; fewer where its
     minute is short, the count printed): the correctness sections first, so
     that a late section running long cannot cut them;
  3. step costs of the draft (bf16, and the INT8 path), the 1.5B and a 7B-class
     target (bf16), built with random weights: ms by rows, prefill per token,
     launches and GPU-busy time of a 1-row step, peak memory, and whether a
     verification's argmax is a decode step's (else a bf16 tie);
  4. the static step (one KV arena, a CUDA graph a row bucket) of the draft (bf16
     and INT8) and both targets: ms by rows beside the HBM floor (the bytes a step
     reads at the measured copy bandwidth), and its greedy tokens against the lean
     forward's;
  5. the real services on the pairs 0.5B -> 7B and 0.5B -> 1.5B at synthetic
     acceptances: target-only and spec ms per token, the RPC cost of a round,
     beside what coordinator/gamma/bound.py predicts from the services' curves
     (and at the acceptance the CPU bench measured for the real pair);
  6. the static step under torch.compile (the INT8 draft, the bf16 draft, the 7B),
     as time allows;
  7. transformers' generate() (static cache, torch.compile) on the targets' random
     weights beside target-only through the services, as time allows.

Each section runs whatever the others did (a failure is shown in its place);
the table is written after every section, and every model of the long ones, as
markdown and JSON, to --out, so a call cut short still returns what it measured.
Exit 1 if a correctness check failed. On a machine without CUDA the same sections run on the CPU on small
shapes (shapes.py); --quick is CI's: fewer acceptances, prompts and tokens.

  python -m specdec_tools.gpu.check [--quick] [--out DIR] [--payload .gpu] [--budget-s 420]
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
import time
import traceback

from specdec_tools.gpu import report, shapes

SEED = 1
ACCEPTANCES = (0.8, 0.6, 0.9)   # the goal's first (issue 48): a short budget ends the services section early
CHI_RUNS = 2000
QUICK_CHI_RUNS = 200  # --quick: the suite runs the 2,000-run test itself (test_end_to_end)
CHI_S = 60.0          # the chi-square's minute: batches of 250 runs until 2,000 or this
COMPILE_S = 90.0      # what one model's compiled step is given (compile, capture, timing) before it starts
COMPILED_ROWS = (1, 8)   # a draft or decode step, and a batch or a γ = 7 verification: a compile a row count
LATE_RESERVE_S = 150.0  # kept from the services for the compiled step and transformers' generate()
# The static step section's models: (label, model, quantize).
STATIC_MODELS = (("draft 0.5B bf16", shapes.DRAFT, "none"), ("draft 0.5B INT8", shapes.DRAFT, "int8"),
                 ("target 1.5B bf16", shapes.TARGET, "none"), ("target 7B bf16", shapes.TARGET_7B, "none"))


def environment(device: str, models: dict[str, shapes.Model]) -> dict:
    import torch
    from specdec_tools.gpu import steps
    info = {"device": device, "torch": torch.__version__, "python": platform.python_version(),
            "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()}
    # What the compiled step section needs (a compiler and headers for what inductor writes).
    from specdec.runtime.paged_step import toolchain_missing
    info["inductor toolchain"] = "; ".join(toolchain_missing("inductor", torch.device(device))) or "ok"
    if device == "cuda":
        info.update(gpu=torch.cuda.get_device_name(0), cuda=torch.version.cuda, driver=_driver(),
                    gpu_memory_gb=round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1))
        config = json.loads((models[shapes.TARGET].path / "config.json").read_text())
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        info["sdpa"] = steps.sdpa_backends("cuda", config["num_attention_heads"], config["num_key_value_heads"],
                                           head_dim)
    return info


def _driver() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20).stdout.strip() or "-"
    except (OSError, subprocess.TimeoutExpired):
        return "-"


def tiny_greedy(device: str) -> dict:
    from specdec.weights.pairs import PAIRS
    from specdec_tools import launcher
    from specdec_tools.checks import GREEDY_PROMPTS, greedy_runs
    stack = launcher.Stack(launcher.StackOptions.for_pair(PAIRS["tiny"], port=0, device=device, gamma="4"))
    try:
        drafted, differing = greedy_runs(stack.launch().address)
    finally:
        stack.stop()
    if differing:
        prompt, spec, target = differing[0]
        raise AssertionError(f"greedy output differs from target-only on {prompt!r} (fp32): {spec} vs {target}")
    return {"prompts": len(GREEDY_PROMPTS), "identical": len(GREEDY_PROMPTS), "drafted": drafted}


def step_costs(device: str, models: dict[str, shapes.Model], quick: bool, on_model) -> list[dict]:
    from specdec_tools.gpu import steps
    draft, target, big = models[shapes.DRAFT], models[shapes.TARGET], models[shapes.TARGET_7B]
    plan = [("draft bf16", draft, "none"), ("draft INT8", draft, "int8"), ("target 1.5B bf16", target, "none"),
            ("target 7B bf16", big, "none")]
    out = []
    for label, model, quantize in plan:
        try:
            measured = steps.measure(label, str(model.path), model.parameters, device=device, dtype="bf16",
                                     quantize=quantize, head_vocab=_head_vocab(quantize), seed=SEED,
                                     repeats=3 if quick else 5)
            row = measured.row()
        except Exception as error:  # one model's failure (a missing kernel package) is its row
            row = {"label": label, "error": _error(error)}
        out.append(row)
        on_model(out)
    return out


def argmax_consistency(device: str, models: dict[str, shapes.Model]) -> dict:
    from specdec.runtime.models import load_model
    from specdec_tools.gpu import steps
    loaded = load_model(str(models[shapes.TARGET].path), dtype="bf16", device=device, random_weights=SEED)
    found = steps.row_consistency(loaded)
    if not found["ties_only"]:
        raise AssertionError(f"a verification's argmax left a decode step's by more than a bf16 tie: {found}")
    return found


def static_step(device: str, models: dict[str, shapes.Model]) -> dict:
    import torch
    from specdec_tools.gpu import static
    bandwidth = static.copy_bandwidth_gbps(torch.device(device)) if device.startswith("cuda") else 0.0
    out = []
    for label, name, quantize in STATIC_MODELS:
        try:
            out.append(static.measure(label, str(models[name].path), device=device, seed=SEED, bandwidth_gbps=bandwidth,
                                      quantize=quantize, head_vocab=_head_vocab(quantize)))
        except Exception as error:  # one model's failure is its row
            out.append({"label": label, "error": _error(error)})
    return {"copy_gbps": bandwidth, "models": out}


def compiled_step(device: str, models: dict[str, shapes.Model], bandwidth_gbps: float, deadline: float,
                  on_model=lambda value: None) -> dict:
    """The static step under torch.compile (inductor, C++ kernels on the CPU) at the rows a draft
    step and a short verification take: the INT8 draft's cast then folds into its matmuls.
    A model whose compile would not finish before `deadline` (COMPILE_S each) is left out, said so."""
    from specdec_tools.gpu import static
    backend = "inductor"
    out, skipped = [], []
    result = {"copy_gbps": bandwidth_gbps, "backend": backend, "models": out, "skipped": skipped}
    for label, name, quantize in (("draft 0.5B INT8, compiled", shapes.DRAFT, "int8"),
                                  ("draft 0.5B bf16, compiled", shapes.DRAFT, "none"),
                                  ("target 7B bf16, compiled", shapes.TARGET_7B, "none")):
        if time.monotonic() + COMPILE_S > deadline:
            skipped.append(f"{label} (time)")
            continue
        if quantize == "int8" and not device.startswith("cuda"):
            skipped.append(f"{label} (the CPU's INT8 is fbgemm's packed kernels, which do not compile)")
            continue
        try:
            out.append(static.measure(label, str(models[name].path), device=device, seed=SEED,
                                      bandwidth_gbps=bandwidth_gbps, quantize=quantize,
                                      head_vocab=_head_vocab(quantize), compile=backend, rows=COMPILED_ROWS))
        except Exception as error:
            out.append({"label": label, "error": _error(error)})
        on_model(result)
    return result


def transformers_generate(device: str, models: dict[str, shapes.Model], quick: bool, deadline: float,
                          on_model=lambda value: None) -> dict:
    """transformers' generate() (static cache, torch.compile) on the targets' random weights: what
    target-only through the services is held against. The 7B first; each only where COMPILE_S remain."""
    from specdec_tools.gpu import hf_baseline
    out, skipped = [], []
    result = {"models": out, "skipped": skipped}
    for label, name in (("target 7B bf16", shapes.TARGET_7B), ("target 1.5B bf16", shapes.TARGET)):
        if time.monotonic() + COMPILE_S > deadline:
            skipped.append(f"{label} (time)")
            continue
        try:
            out.append(hf_baseline.decode_ms_per_token(label, str(models[name].path), device=device, seed=SEED,
                                                       new_tokens=12 if quick else 64))
        except Exception as error:
            out.append({"label": label, "error": _error(error)})
        on_model(result)
    return result


def _head_vocab(quantize: str) -> int:
    return shapes.PAIR.draft_head_vocab if quantize != "none" else 0


def draft_path(step_rows: list[dict] | None, static: dict | None = None, forward: str = "lean") -> tuple[str, str]:
    """The draft's path for the services: the INT8 path `specdec up` serves a draft in,
    unless it timed slower than bf16 on the forward the services run (the static step's
    table for `paged`, where the eager INT8 cast is a kernel of its own; the step costs'
    for `lean`) or failed there; and why."""
    if forward == "paged":
        static_rows = {r["label"]: r.get("rows_ms") for r in (static or {}).get("models", [])}
        (bf16_label, *_), (int8_label, *_) = STATIC_MODELS[:2]
        rows_ms = {"draft INT8": static_rows.get(int8_label), "draft bf16": static_rows.get(bf16_label)}
    else:
        rows_ms = {r["label"]: r.get("rows_ms") for r in step_rows or []}
    int8, bf16 = (ms.get(1, ms.get("1")) if ms else None
                  for ms in (rows_ms.get("draft INT8"), rows_ms.get("draft bf16")))
    on = "the static step's" if forward == "paged" else "its"
    if int8 is None:
        return "none", f"bf16: the INT8 path did not run on the {forward} forward here"
    if bf16 is not None and bf16 < int8:
        return "none", f"bf16: {on} 1-row step took {bf16:.2f} ms against the INT8 path's {int8:.2f}"
    return "int8", f"INT8: {on} 1-row step took {int8:.2f} ms" + (f" against bf16's {bf16:.2f}" if bf16 else "")


def services_forward(static: dict | None) -> tuple[str, str]:
    """The services' forward: `--forward paged` (one KV arena, a CUDA graph a bucket) where the
    static step section captured every bf16 model's graphs and kept its greedy tokens (or parted
    at a bf16 tie); else the lean forward; and why."""
    rows = {r["label"]: r for r in (static or {}).get("models", [])}
    for label in (label for label, _, quantize in STATIC_MODELS if quantize == "none"):
        r = rows.get(label)
        if r is None or "error" in r or not r.get("graphs"):
            return "lean", f"lean: the static step of {label} " + (
                "did not run" if r is None else f"failed ({r['error'][:80]})" if "error" in r else "ran without graphs")
        greedy = r.get("greedy", {})
        if greedy.get("agreed") != greedy.get("of") and greedy.get("first_difference_bf16_steps", 99) > 2.0:
            return "lean", f"lean: the static step of {label} left the lean forward's greedy tokens ({greedy})"
    return "paged", "paged: every bf16 model's static step captured its graphs and kept the lean forward's tokens"


def served(device: str, models: dict[str, shapes.Model], quick: bool, prompts: list[str], deadline: float,
           draft_quantize: str, forward: str, on_run) -> list[dict]:
    from specdec_tools.gpu import services
    acceptances = [0.8] if quick else list(ACCEPTANCES)
    results = []
    # The 7B first: the pair a GPU serves (a 1.5B step is too short for a separate drafter to pay over RPC).
    for pair, target in (("0.5B -> 7B", models[shapes.TARGET_7B]), ("0.5B -> 1.5B", models[shapes.TARGET])):
        if time.monotonic() > deadline:
            results.append({"pair": pair, "skipped": ["out of time"]})
            continue
        result = services.serve_pair(
            pair, models[shapes.DRAFT], target, device=device, seed=SEED, draft_dtype="bf16",
            draft_quantize=draft_quantize, head_vocab=shapes.PAIR.draft_head_vocab if draft_quantize != "none"
            else 0, target_dtype="bf16", forward=forward, acceptances=acceptances, prompts=prompts,
            max_new_tokens=12 if quick else 64, deadline=deadline, on_run=lambda r: on_run(results))
        results.append(report.pair_dict(result))
        on_run(results)
    return results


def chi_square(device: str, deadline: float, max_runs: int = CHI_RUNS) -> dict:
    """The tiny pair's first two sampled tokens against the target's exact distribution,
    in batches of 250 runs until `max_runs` or the deadline."""
    import collections
    import concurrent.futures
    from specdec.rpc.serving import channel
    from specdec.runtime.models import load_model
    from specdec.spec.sampling import SamplingConfig
    from specdec.v1 import coordinator_pb2_grpc
    from specdec.weights.pairs import PAIRS
    from specdec_tools import launcher
    from specdec_tools.checks import generate
    from specdec_tools.distribution import chi_square_p, exact_first_two_token_distribution, observed_outcome
    prompt = "Hello, world! How are"
    target = load_model("tiny-target", device=device)
    p1, joint = exact_first_two_token_distribution(target, target.tokenizer.encode(prompt),
                                                   SamplingConfig(temperature=0.8, top_k=40))
    stack = launcher.Stack(launcher.StackOptions.for_pair(PAIRS["tiny"], port=0, device=device, gamma="4"))
    responses = []
    try:
        with channel(stack.launch().address) as ch, concurrent.futures.ThreadPoolExecutor(8) as pool:
            stub = coordinator_pb2_grpc.CoordinatorStub(ch)
            while len(responses) < max_runs and (not responses or time.monotonic() < deadline):
                seeds = range(len(responses), min(max_runs, len(responses) + 250))
                responses += pool.map(lambda seed: generate(stub, prompt, True, 3, temperature=0.8, top_k=40,
                                                            seed=seed), seeds)
    finally:
        stack.stop()
    first, pairs = collections.Counter(), collections.Counter()
    for r in responses:
        x1, pair = observed_outcome(r)
        first[x1] += 1
        pairs[pair] += 1
    n = len(responses)
    p_first, p_pairs = chi_square_p(first, p1, n), chi_square_p(pairs, joint, n)
    accepted = sum(r.stats.accepted_tokens for r in responses) / max(1, sum(r.stats.draft_tokens for r in responses))
    result = {"runs": n, "p_first": round(float(p_first), 4), "p_pairs": round(float(p_pairs), 4),
              "acceptance": round(accepted, 3)}
    if min(p_first, p_pairs) <= 1e-3:
        raise AssertionError(f"sampled output is not the target's: {result}")
    return result


def _error(error: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(error), error)).strip().splitlines()[-1][:300]


def questions(payload: pathlib.Path | None, count: int) -> list[str]:
    """`count` prompts of different categories from the payload's questions (the bench's where there is none)."""
    from specdec_tools.bench.data import DEFAULT_QUESTIONS
    path = payload / "questions_dev.jsonl" if payload and (payload / "questions_dev.jsonl").exists() \
        else DEFAULT_QUESTIONS
    if not path.exists():
        return ["Write a function that reverses a linked list.", "Translate to French: the weather is fine."][:count]
    seen, out = set(), []
    for line in path.read_text().splitlines():
        q = json.loads(line)
        if q["category"] not in seen:
            seen.add(q["category"])
            out.append(q["turns"][0])
        if len(out) == count:
            break
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--quick", action="store_true",
                        help="the suite's: one acceptance, one prompt, 12 tokens, 200 sampled runs")
    parser.add_argument("--payload", type=pathlib.Path, default=pathlib.Path(".gpu"))
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path(os.environ.get("OUT") or "gpu_check_out"))
    parser.add_argument("--budget-s", type=float, default=420.0, help="the whole check's time (default 7 minutes)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    deadline = started + args.budget_s
    import torch
    device = args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    payload = args.payload if (args.payload / "tokenizer").is_dir() else None
    table = report.Report(args.out, device, args.quick)
    work = pathlib.Path(tempfile.mkdtemp(prefix="gpu_check_"))
    models = shapes.prepare(payload, work, full_shapes=device == "cuda")
    table.meta["shapes"] = "real" if device == "cuda" else "small (2 layers)"
    table.meta["payload"] = str(payload) if payload else "none (tiny tokenizer)"
    table.meta["models"] = {name: f"{m.parameters:.3g}B parameters" for name, m in models.items()}
    acceptance = json.loads((payload / "acceptance.json").read_text()) if payload else None
    table.meta["cpu_acceptance"] = acceptance
    failed = False

    def section(name: str, run, correctness: bool = False):
        nonlocal failed
        began = time.monotonic()
        try:
            table.set(name, run(), seconds=time.monotonic() - began)
        except Exception as error:
            failed |= correctness
            table.fail(name, _error(error), traceback.format_exc(), seconds=time.monotonic() - began)
        print(f"gpu_check: {name}: {table.status(name)} ({time.monotonic() - began:.0f} s, "
              f"{time.monotonic() - started:.0f} s in all)", file=sys.stderr, flush=True)

    section("environment", lambda: environment(device, models))
    section("tiny pair greedy", lambda: tiny_greedy(device), correctness=True)
    section("chi-square", lambda: chi_square(device, time.monotonic() + CHI_S,
                                             QUICK_CHI_RUNS if args.quick else CHI_RUNS), correctness=True)
    section("step costs", lambda: step_costs(device, models, args.quick, lambda rows: table.partial("step costs", rows)))
    section("argmax, k rows against 1", lambda: argmax_consistency(device, models), correctness=True)
    section("static step", lambda: static_step(device, models))
    forward, why = services_forward(table.value("static step"))
    table.meta["services' forward"] = why
    draft_quantize, why = draft_path(table.value("step costs"), table.value("static step"), forward)
    table.meta["services' draft"] = why
    section("services", lambda: served(device, models, args.quick, questions(payload, 1 if args.quick else 2),
                                       deadline - LATE_RESERVE_S, draft_quantize, forward,
                                       lambda rows: table.partial("services", rows)))
    static_done = table.value("static step") or {}
    section("compiled step", lambda: compiled_step(device, models, static_done.get("copy_gbps", 0.0), deadline,
                                                   lambda value: table.partial("compiled step", value)))
    section("transformers generate", lambda: transformers_generate(
        device, models, args.quick, deadline, lambda value: table.partial("transformers generate", value)))
    table.write()
    print(table.markdown())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
