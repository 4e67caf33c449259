"""All torch work of a process runs on one thread (see specdec.runtime.torch_thread)."""
from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch

from specdec.runtime import torch_thread
from specdec.runtime.sequence import SequenceCache


def test_run_executes_on_one_thread_and_inline_when_already_there():
    idents = {torch_thread.run(threading.get_ident) for _ in range(3)}
    assert len(idents) == 1 and threading.get_ident() not in idents
    assert torch_thread.run(lambda: torch_thread.run(torch_thread.on_it))  # nested: inline, no deadlock


def test_exceptions_come_back_to_the_caller():
    with pytest.raises(ZeroDivisionError):
        torch_thread.run(lambda: 1 / 0)


def test_forwards_from_many_threads_run_on_the_torch_thread(tiny_target):
    seen: set[int] = set()
    handle = tiny_target.model.get_input_embeddings().register_forward_hook(
        lambda *_: seen.add(threading.get_ident()))
    try:
        threads = [threading.Thread(target=lambda: SequenceCache(tiny_target, [5, 6, 7]).forward([], keep_last=1))
                   for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        handle.remove()
    assert seen == {torch_thread.run(threading.get_ident)}


def test_set_threads_reaches_the_torch_thread():
    before = torch_thread.run(torch.get_num_threads)
    try:
        torch_thread.set_threads(1)
        assert torch_thread.run(torch.get_num_threads) == 1
    finally:
        torch_thread.set_threads(before)


@pytest.mark.parametrize("service", ["drafter", "verifier"])
def test_model_services_let_idle_openmp_workers_sleep_soon_unless_told_otherwise(service):
    # Importing the entry module sets it before torch loads (-W error: a late call warns).
    code = f"import os, {service}.__main__, torch; print(os.environ.get('GOMP_SPINCOUNT'))"
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    run = lambda extra: subprocess.run([sys.executable, "-W", "error", "-c", code], env={**env, **extra},
                                       capture_output=True, text=True, timeout=120)
    default = run({})
    assert default.returncode == 0, default.stderr
    assert default.stdout.strip() == torch_thread.SPIN_COUNT
    assert run({"GOMP_SPINCOUNT": "77"}).stdout.strip() == "77"
    assert run({"OMP_WAIT_POLICY": "PASSIVE"}).stdout.strip() == "None"
