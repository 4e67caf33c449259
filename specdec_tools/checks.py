"""What scripts/gpu_check.py and deploy/docker/image_check.py share: a list of
named checks run in turn, whatever the others did, printed as one table (a
failing check shows its last traceback line there and the whole traceback under
it); and greedy speculative output compared with target-only through a running
coordinator."""
from __future__ import annotations

import sys
import time
import traceback
from typing import Callable

GREEDY_PROMPTS = ["def fibonacci(n):", "The weather today is sunny and", "Explain what a hash table is."]


def generate(stub, prompt: str, speculate: bool, max_new_tokens: int = 24, gamma: int = 0, **sampling):
    """One Generate through a coordinator stub: speculative (at `gamma`, 0: the server's) or target-only."""
    from specdec.v1 import common_pb2, coordinator_pb2 as pb
    request = pb.GenerateRequest(prompt=prompt, max_new_tokens=max_new_tokens,
                                 sampling=common_pb2.SamplingParams(**sampling))
    request.speculation.enabled = speculate
    request.speculation.gamma = gamma if speculate else 0
    return stub.Generate(request, timeout=600)


def greedy_runs(address: str, gamma: int = 0,
                prompts: list[str] = GREEDY_PROMPTS) -> tuple[int, list[tuple[str, list[int], list[int]]]]:
    """Each prompt greedy, speculative and target-only, through the coordinator at
    `address`: the tokens drafted, and (prompt, speculative ids, target-only ids)
    for each prompt whose two outputs differ."""
    from specdec.rpc.serving import channel
    from specdec.v1 import coordinator_pb2_grpc
    drafted, differing = 0, []
    with channel(address) as ch:
        stub = coordinator_pb2_grpc.CoordinatorStub(ch)
        for prompt in prompts:
            spec, target = generate(stub, prompt, True, gamma=gamma), generate(stub, prompt, False)
            if list(spec.token_ids) != list(target.token_ids):
                differing.append((prompt, list(spec.token_ids), list(target.token_ids)))
            drafted += spec.stats.draft_tokens
    return drafted, differing


def run_checks(tool: str, title: str, checks: list[tuple[str, Callable[[], str]]]) -> int:
    """Run each check (it returns its detail, or raises); print the table; 1 if any failed, else 0."""
    rows, failures = [], []
    for name, check in checks:
        started = time.perf_counter()
        try:
            result, ok = check(), "ok"
        except Exception:
            result, ok = traceback.format_exc().strip().splitlines()[-1], "FAILED"
            failures.append((name, traceback.format_exc()))
        rows.append((name, ok, f"{time.perf_counter() - started:.0f}", result))
        print(f"{tool}: {name}: {ok}", file=sys.stderr, flush=True)
    print(f"\n| check ({title}) | result | s | detail |\n|---|---|---|---|")
    for name, ok, seconds, detail in rows:
        print(f"| {name} | {ok} | {seconds} | {detail} |")
    for name, trace in failures:
        print(f"\n### {name}\n\n```\n{trace}```")
    return 1 if failures else 0
