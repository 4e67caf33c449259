"""A list of named checks run in turn, whatever the others did, and one table:
what scripts/gpu_check.py and deploy/docker/image_check.py print. A failing
check shows its last traceback line in the table and the whole traceback under it."""
from __future__ import annotations

import sys
import time
import traceback
from typing import Callable


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
