"""`specdec bench`'s command line and its run: every system on every prompt, interleaved."""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time
import uuid
from dataclasses import asdict

from specdec_tools import launcher
from specdec.runtime import torch_thread
from specdec.runtime.models import gguf_source, load_model
from specdec.weights.pairs import PAIRS
from specdec_tools.bench.data import (AUTO, AUTO_BF16, AUTO_MODEL, AUTO_NOSTOP, BF16, DEFAULT_QUESTIONS, HF_ASSISTED,
                                      HF_GENERATE, LLAMA_CPP, LLAMA_CPP_SPEC, REPLICA, Run, TARGET_ONLY, COLD,
                                      TARGET_ONLY_BF16, load_questions, task_of)
from specdec_tools.bench.report import (auto_by_request, best_gamma, chart, markdown, summarize, turn_markdown,
                                        turn_summary, within)
from specdec_tools.bench.systems import (InProcessSystems, LlamaCppSystems, ServiceSystems, chat_ids, llama_cpp_probe,
                                         service_curves)


def run_order(systems: list[str], group: int) -> list[str]:
    """The systems' order for one prompt and temperature (`group`): the rows of a Williams
    design in turn, so each system runs first equally often and follows each other system
    equally often. A run leaves the machine warm or busy for the next (llama.cpp's threads
    spin on after a generate; caches hold the last model's weights): under a rotation of one
    order, spec-auto followed a llama.cpp system in 35 of 35 runs and target-only in 9 of
    36, and a run after llama.cpp took 1.01 of the same prompt's other service run against
    0.985 after the others (1e3fc2d, ed7cfd8: 2.5% against spec-auto)."""
    n = len(systems)
    first, low, high = [0], 1, n - 1
    while len(first) < n:   # 0, 1, n-1, 2, n-2, ...: each difference mod n once
        first.append(low)
        low += 1
        if len(first) < n:
            first.append(high)
            high -= 1
    rows = [[(k + shift) % n for k in first] for shift in range(n)]
    if n % 2:   # odd: the square and its mirror together balance the predecessors
        rows += [row[::-1] for row in rows]
    return [systems[k] for k in rows[group % len(rows)]]


WARMUP_TOKENS = 8   # a warm-up run's new tokens: its prefill and first steps are what run cold


def warm_up(systems: list[str], runner_for, question, temperature: float, seed: int, prompt_ids: list[int],
            served) -> list[dict]:
    """Each system once before any run is measured, WARMUP_TOKENS new tokens, untimed: a
    stack's first requests pay one-off costs (weights paged in, a first prefill's kernels,
    llama.cpp's first graph) that would fall on whichever system the order puts first. In
    four dev-half runs on the AVX-512 EPYC (2026-12-06) the first run, spec-auto's, went at
    0.79-0.95x the speed of the target-only run of the same prompt right after it.
    `served(runner)`: the runner's requests go through the services (a cache salt of their own)."""
    warmups = []
    for system in systems:
        runner = runner_for(system)
        measured, runner.max_new_tokens = runner.max_new_tokens, WARMUP_TOKENS
        try:
            run = runner.run(system, question, temperature, seed, prompt_ids,
                             **({"cache_salt": uuid.uuid4().hex} if served(runner) else {}))
        finally:
            runner.max_new_tokens = measured
        warmups.append({"system": system, "new_tokens": run.new_tokens, "seconds": run.seconds})
    return warmups


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="specdec bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--pair", default="qwen-coder", choices=sorted(PAIRS))
    p.add_argument("--questions", type=pathlib.Path, default=DEFAULT_QUESTIONS)
    p.add_argument("--categories", help="comma-separated (default: all)")
    p.add_argument("--limit", type=int, help="questions per category")
    p.add_argument("--skip", type=int, default=0, help="pass over each category's first N questions")
    p.add_argument("--per-task", type=int,
                   help="questions per Spec-Bench task instead, spread over its categories (at least one each)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--gammas", default="2,4,6")
    p.add_argument("--temperatures", default="0,0.7")
    p.add_argument("--no-hf", action="store_true", help="skip the in-process transformers baselines")
    p.add_argument("--no-target-only", action="store_true", help="skip target-only (no speedups against it)")
    p.add_argument("--no-model-only", action="store_true",
                   help="skip spec-auto-model (auto γ, the draft model alone: no n-gram lookups)")
    p.add_argument("--no-bf16", action="store_true",
                   help="skip the second stack (bf16 target)")
    p.add_argument("--llama-cpp", action="store_true",
                   help="also run llama.cpp on the target's GGUF (needs llama-cpp-python)")
    p.add_argument("--replicate-gamma", type=int, metavar="N",
                   help="run spec-gN twice, as spec-gN and spec-gN-replica: the run's own noise floor")
    p.add_argument("--ablate-confidence-stop", action="store_true",
                   help="also run spec-auto without the draft-confidence early stop")
    p.add_argument("--turns", type=int, choices=(1, 2), default=1,
                   help="2: after each service system's answer to an MT-bench question, its second turn with that "
                        "answer in the history, as Spec-Bench runs them; and the same second turn again with a cache "
                        "salt of its own (SYSTEM-cold: what it costs without the prefix caches)")
    p.add_argument("--quick", action="store_true",
                   help="under 5 minutes: one question of each of 3 short-prompt categories, 32 new tokens")
    p.add_argument("--threads", type=int, default=2, help="torch threads, for the services and in-process alike")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="the services' device (on cuda the pair's int4 target is served in its dtype)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--no-warmup", action="store_true",
                   help=f"measure from the first run: no untimed run of each system first ({WARMUP_TOKENS} tokens "
                        "of the first prompt)")
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench_out"))
    args = p.parse_args(argv)
    if args.replicate_gamma is not None and str(args.replicate_gamma) not in args.gammas.split(","):
        p.error(f"--replicate-gamma {args.replicate_gamma} must be one of --gammas ({args.gammas})")
    if args.quick:
        args.limit = args.limit or 1
        args.max_new_tokens = min(args.max_new_tokens, 32)
        # Short prompts, so the few tokens measure decoding rather than prefill.
        args.categories = args.categories or "coding,math_reasoning,translation"
    return args


def second_turns(runner: ServiceSystems, system: str, question, temperature: float, seed: int, first: Run,
                 tokenizer, salt: str) -> list[Run]:
    """The question's second turn after `first`'s answer: as served (under the first
    turn's cache salt, so the prefix caches hold the first turn), then cold (a cache
    salt of its own)."""
    messages = [{"role": "user", "content": question.prompt},
                {"role": "assistant", "content": tokenizer.decode(first.token_ids, skip_special_tokens=True)},
                {"role": "user", "content": question.second_turn}]
    ids = chat_ids(tokenizer, messages)
    return [runner.run(system, question, temperature, seed, ids, messages, cache_salt=salt, turn=2),
            runner.run(system, question, temperature, seed, ids, messages, cache_salt=uuid.uuid4().hex,
                       label=system + COLD, turn=2)]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--structured" in argv:   # the structured-outputs bench: its own tasks and systems
        from specdec_tools.bench import structured
        return structured.main([a for a in argv if a != "--structured"])
    args = parse_args(argv)
    torch_thread.set_threads(args.threads)
    pair = PAIRS[args.pair]
    categories = args.categories.split(",") if args.categories else None
    questions = load_questions(args.questions, categories, args.limit, args.per_task, args.skip)
    temperatures = [float(t) for t in args.temperatures.split(",")]
    systems = [f"spec-g{int(g)}" for g in args.gammas.split(",") if g] + [AUTO] + (
        [] if args.no_model_only else [AUTO_MODEL]) + ([] if args.no_target_only else [TARGET_ONLY])
    if not args.no_bf16 and pair.target_quantize != "none":
        systems += [AUTO_BF16, TARGET_ONLY_BF16]
    if args.llama_cpp:
        systems += [LLAMA_CPP, LLAMA_CPP_SPEC]
    if args.replicate_gamma is not None:
        systems.insert(systems.index(AUTO), f"spec-g{args.replicate_gamma}{REPLICA}")
    if args.ablate_confidence_stop:
        systems.insert(systems.index(AUTO) + 1, AUTO_NOSTOP)
    if not args.no_hf:
        systems += [HF_GENERATE, HF_ASSISTED]
    say = lambda message: print(f"bench: {message}", file=sys.stderr, flush=True)  # noqa: E731
    launcher.pull_models([pair.draft, pair.target], say=say)
    ggufs = [g for g in (gguf_source(pair.target), gguf_source(pair.draft)) if g is not None]
    if args.llama_cpp and (why := llama_cpp_probe(ggufs, args.threads)):
        say(f"--llama-cpp: llama.cpp does not run on this machine, its systems are left out: {why}")
        args.llama_cpp = False
        systems = [s for s in systems if not s.startswith(LLAMA_CPP)]
    options = launcher.StackOptions.for_pair(pair, port=0, threads=args.threads, device=args.device)
    stack = launcher.Stack(options)
    stacks = [stack]
    started = time.perf_counter()
    try:
        say(f"starting the {args.pair} services")
        coordinator = stack.launch()
        stack.settle(say=say)
        services = ServiceSystems(coordinator.address, args.max_new_tokens)
        bf16_services = None
        if AUTO_BF16 in systems:
            say("starting the bf16 stack (bf16 target)")
            stacks.append(launcher.Stack(launcher.StackOptions.for_pair(
                pair, port=0, threads=args.threads, target_quantize="none", device=args.device)))
            bf16_services = ServiceSystems(stacks[-1].launch().address, args.max_new_tokens)
            stacks[-1].settle(say=say)
        target = load_model(pair.target, dtype=pair.target_dtype)
        in_process = None
        if not args.no_hf:
            draft = load_model(pair.draft, dtype=pair.draft_dtype, quantize=pair.draft_quantize,
                               head_vocab=pair.draft_head_vocab)
            in_process = InProcessSystems(target, draft, args.max_new_tokens)
        runs: list[Run] = []
        turn_runs: list[Run] = []  # --turns 2: first turns, and the second turns after them
        prompts = {q: chat_ids(target.tokenizer, q.prompt) for q in questions}
        llama = None
        if args.llama_cpp:
            context = min(max(len(p) for p in prompts.values()) + args.max_new_tokens + 64, target.max_context)
            llama = LlamaCppSystems(gguf_source(pair.target), gguf_source(pair.draft), args.threads,
                                    args.max_new_tokens, target.eos_token_ids, context)
        too_long = [q for q in questions if len(prompts[q]) + args.max_new_tokens > target.max_context]
        for q in too_long:
            say(f"skipping {q.category} q{q.question_id}: {len(prompts[q])} prompt tokens + {args.max_new_tokens} "
                f"exceed the target's context window ({target.max_context})")
        questions = [q for q in questions if q not in too_long]
        total = len(questions) * len(temperatures) * len(systems)
        args.out.mkdir(parents=True, exist_ok=True)
        progress = open(args.out / "runs.jsonl", "w", encoding="utf-8")  # every run as it ends: a crash loses none

        def runner_for(system: str):
            return (in_process if system in (HF_GENERATE, HF_ASSISTED) else
                    llama if system.startswith(LLAMA_CPP) else
                    bf16_services if system.endswith(BF16) else services)
        warmups = [] if args.no_warmup or not questions else warm_up(
            systems, runner_for, questions[0], temperatures[0], args.seed - 1, prompts[questions[0]],
            lambda runner: runner in (services, bf16_services))
        if warmups:
            say(f"warm-up: {len(warmups)} systems ran {WARMUP_TOKENS} tokens of {questions[0].category} "
                f"q{questions[0].question_id} once, not counted ({sum(w['seconds'] for w in warmups):.1f} s)")
        for qi, question in enumerate(questions):
            prompt_ids = prompts[question]
            for temperature in temperatures:
                group = qi * len(temperatures) + temperatures.index(temperature)
                for system in run_order(systems, group):
                    runner = runner_for(system)
                    # Every service run prefills its prompt cold, as llama.cpp's and transformers'
                    # do: under a salt of its own, the prefix caches hold nothing another system's
                    # run of the same prompt left (the first system of a prompt would pay the
                    # prefill that the others then skip).
                    served = runner in (services, bf16_services)
                    salt = uuid.uuid4().hex
                    run = runner.run(system, question, temperature, args.seed + qi, prompt_ids,
                                     **({"cache_salt": salt} if served else {}))
                    runs.append(run)
                    progress.write(json.dumps(asdict(run)) + "\n")
                    progress.flush()
                    if args.turns == 2 and question.second_turn and served:
                        turn_runs.append(run)
                        for second in second_turns(runner, system, question, temperature, args.seed + qi, run,
                                                   target.tokenizer, salt):
                            turn_runs.append(second)
                            progress.write(json.dumps(asdict(second)) + "\n")
                            say(f"  second turn, {second.system}: {second.stat('prompt_tokens'):.0f} prompt tokens "
                                f"({second.stat('prefix_cached_tokens'):.0f} cached), first token in "
                                f"{second.first_token_ms:.0f} ms")
                    say(f"[{len(runs)}/{total} {time.perf_counter() - started:.0f} s] {question.category} "
                        f"q{question.question_id} T={temperature:g} "
                        f"{system}: {run.new_tokens} tokens in {run.seconds:.1f} s "
                        f"({run.tokens_per_second:.2f} tok/s)")
        services.close()
        progress.close()
        curves = service_curves(stack, say)
    finally:
        for one in stacks:
            one.stop()
    rows = summarize(runs, systems)
    picks = best_gamma(rows)
    tasks = sorted({task_of(q.category) for q in questions})
    meta = dict(pair=args.pair, draft=pair.draft, target=pair.target, questions=len(questions),
                skipped=[f"{q.category}/{q.question_id}" for q in too_long],
                max_new_tokens=args.max_new_tokens, temperatures=temperatures, threads=args.threads,
                systems=systems, warmups=warmups, wall_s=time.perf_counter() - started,
                temperature_keys=[f"T={t:g}" for t in temperatures], best_gamma=picks,
                auto_within_5pct=within(picks, tasks, "auto_vs_best"),
                replica_within_5pct=within(picks, tasks, "replica_vs_best"), curves=curves,
                auto_by_request=auto_by_request(runs),
                median_tokens_per_second={s: statistics.median(r.tokens_per_second for r in runs if r.system == s)
                                          for s in systems})
    args.out.mkdir(parents=True, exist_ok=True)
    turns = turn_summary(turn_runs) if turn_runs else []
    (args.out / "bench.json").write_text(json.dumps(
        dict(meta=meta, summary=rows, runs=[asdict(r) for r in runs], turns=turns,
             turn_runs=[asdict(r) for r in turn_runs if r.turn == 2]), indent=1))
    table = markdown(rows, meta) + (turn_markdown(turns) if turns else "")
    (args.out / "bench.md").write_text(table)
    chart(rows, systems, args.out / "bench.png")
    print(table)
    say(f"wrote {args.out / 'bench.json'}, {args.out / 'bench.md'}, {args.out / 'bench.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
