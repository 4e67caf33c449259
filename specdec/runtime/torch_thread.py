"""All of a process's torch work on one thread.

torch's CPU kernels parallelize with OpenMP, and an OpenMP runtime keeps a team
of worker threads for each thread that has run a parallel region. With two such
threads alive in one process, the int4 kernel took 50% longer per call here (326
against 218 µs for one row of a 1536 x 8960 weight) and a model step 30% longer
(52 against 40 ms for the 1.5B in int4), even while the other thread sat idle.
A gRPC server runs each call on one of many pool threads, so a model service
would pay that on every forward. Loading, warm-up, every forward and the
sampling math around it therefore run here, on one long-lived thread; callers
on other threads wait for their turn (which the model's one-forward-at-a-time
rule imposed already). Code already on this thread runs inline.
"""
from __future__ import annotations

import functools
import os
import sys
import threading
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, TypeVar

T = TypeVar("T")

_ident: int | None = None

# How long an OpenMP worker of libgomp (torch's CPU runtime) spins for more work
# before it sleeps. The default, 300,000 spins, is some 15 ms here: right after a
# forward, the workers of one model service keep both cores busy while the other
# service's forward starts. Two services take turns on the same cores every round,
# so each paid it: through the services a draft step (20 ms in-process) took 32 ms
# and a 2-row verify (42 ms) 57 ms. 10,000 spins still cover the microseconds
# between the ops of one forward (with no spinning at all a draft step took 29 ms)
# and sleep within a fraction of a millisecond after it: 25 and 47 ms.
# docs/runs/quantization.md has the measurement.
SPIN_COUNT = "10000"


def spin_briefly() -> None:
    """Before torch is imported (libgomp reads it once, at load): let idle OpenMP
    workers sleep soon, for a process that shares its cores with another model
    service. An explicit GOMP_SPINCOUNT or OMP_WAIT_POLICY wins."""
    if "GOMP_SPINCOUNT" in os.environ or "OMP_WAIT_POLICY" in os.environ:
        return
    if "torch" in sys.modules:
        warnings.warn("spin_briefly() after torch was imported has no effect", stacklevel=2)
        return
    os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT


def _remember() -> None:
    global _ident
    _ident = threading.get_ident()


_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch", initializer=_remember)


def on_it() -> bool:
    return threading.get_ident() == _ident


def run(fn: Callable[..., T], *args, **kwargs) -> T:
    """fn(*args, **kwargs) on the torch thread; its result, or its exception."""
    if on_it():
        return fn(*args, **kwargs)
    return _executor.submit(fn, *args, **kwargs).result()


def submit(fn: Callable[..., T], *args, **kwargs) -> Future:
    """fn(*args, **kwargs) on the torch thread, after what is queued there; without waiting."""
    return _executor.submit(fn, *args, **kwargs)


def set_threads(count: int) -> None:
    """torch's intra-op thread count, for the torch thread (where it counts: OpenMP
    keeps it per thread) and for the caller."""
    import torch
    torch.set_num_threads(count)
    run(torch.set_num_threads, count)


def runs_on_it(fn: Callable[..., T]) -> Callable[..., T]:
    """Decorator: the function always runs on the torch thread."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return run(fn, *args, **kwargs)
    return wrapper
