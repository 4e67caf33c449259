"""Which kernel runs a layer's call: choices made by timing, and where they live.

A layer offers every kernel that can compute it (`kernels.prepared`); `pick` times
each on the first calls of a layer shape and row bucket, in the forward itself,
and runs the fastest from then on. What was chosen is state of the model that
runs (`KernelState`): a service holds one model, so the process's state is that
model's; two models in one process (tests, the in-process bench peers) each run
under their own with `scope`, so neither inherits the other's choices by accident.
A start profile saves and restores a state's choices (`saved_choices`,
`restore_choices`); `pin` fixes one (an operator's override, or a test's).
"""
from __future__ import annotations

import logging
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator

import torch

if TYPE_CHECKING:
    from specdec.runtime.kernels import Backend

log = logging.getLogger(__name__)
TRIES = 3               # timed calls of each kernel before a bucket's choice; the fastest call counts
# A kernel that took this many times the fastest one's time is not timed again for the bucket.
# A first call's one-off costs (oneDNN building its kernel) rarely reach it, and timing a
# path that slow three times is what a service's start (warm_up.time_prefill_buckets),
# or else a bucket's first request, pays: on an AVX2 CPU emulated bf16 matmuls are 4x its
# int8 kernels.
HOPELESS = 3.0


@dataclass
class KernelState:
    """What choosing kernels has learned for one model."""
    choices: dict[tuple, str] = field(default_factory=dict)   # (*layer key, row bucket) -> the kernel chosen
    # The rows a per-layer choice is timed at (`choose_at`, the services' --kernel-rows): one,
    # a decode step's call, by default; a service that batches many sessions (8 clients:
    # forwards of 8 rows or more) is served better by a choice timed at its usual batch.
    timed_rows: int = 1
    # After restore_choices: a layer key ((kind, out, in)) -> the kernels its choices name.
    named: dict[tuple, set[str]] = field(default_factory=dict)
    failed: set[tuple] = field(default_factory=set)   # (backend, out, in): failed its check on a layer of that shape
    # Kernels' weights that restored choices name for batches of several sessions only, made
    # after the service serves (`Deferred`, `prepare_deferred`).
    deferred: list["Deferred"] = field(default_factory=list)


# The states in force, innermost last. Not thread-local on purpose: a scope entered on a
# caller's thread holds for the forwards it hands the torch thread (torch_thread).
_SCOPES: list[KernelState] = [KernelState()]


def state() -> KernelState:
    """The kernel state in force: the innermost `scope`'s, or the process's."""
    return _SCOPES[-1]


@contextmanager
def scope(kernel_state: KernelState | None = None) -> Iterator[KernelState]:
    """Within: choices are read and made in `kernel_state` (a fresh one if None);
    the state in force before is back after."""
    kernel_state = KernelState() if kernel_state is None else kernel_state
    _SCOPES.append(kernel_state)
    try:
        yield kernel_state
    finally:
        _SCOPES.remove(kernel_state)


def pin(key: tuple, rows: int, name: str) -> None:
    """Fix the kernel of (key, rows)'s bucket to `name` (rows 0: a per-layer choice,
    every call); `pick` runs it without timing (the layer's own if it lacks `name`)."""
    state().choices[(*key, bucket(rows) if rows else 0)] = name


def bucket(rows: int) -> int:
    """Rows alike enough to share a choice: each count up to 8 (kernels take rows
    in passes of 4 or so), then powers of two."""
    return rows if rows <= 8 else 1 << (rows - 1).bit_length()


def chosen(key: tuple, rows: int) -> str | None:
    """The kernel `pick` chose for (key, rows) (not per layer), or None before it has."""
    return state().choices.get((*key, bucket(rows)))


def pick(key: tuple, rows: int, kernels: dict[str, Callable[[], torch.Tensor]],
         per_layer: bool = False) -> torch.Tensor:
    """kernels[name]() for the kernel chosen for (key, rows); the first calls of a
    bucket time each kernel TRIES times and choose. The first kernel is the
    layer's own (torch's): an accelerated one that raises is dropped for the
    bucket, with a line, and the call goes on without it. One kernel: it runs.

    per_layer: one choice for every row count (made on the first call), for a
    layer whose kernels round differently: a verification's rows must get what
    one decode step at a time would, so the kernel may not change with the rows,
    nor with what else shares a batched forward's kernel call (decode rows of many
    sessions gathered with prefill chunks reach 64 rows and more).
    `pick_per_layer` times that first choice on a decode-sized call."""
    table = state().choices
    default = next(iter(kernels))
    if len(kernels) == 1:
        return kernels[default]()
    choice_key = (*key, 0 if per_layer else bucket(rows))
    name = table.get(choice_key)
    if name in kernels:
        if name == default:
            return kernels[name]()
        try:
            return kernels[name]()
        except Exception as exc:
            log.warning("kernel %s failed on %s (%s: %s); the layer's own kernel runs there from now on", name,
                        choice_key, type(exc).__name__, str(exc).splitlines()[0][:120] if str(exc) else "")
            table[choice_key] = default
            return kernels[default]()
    best: dict[str, float] = {}
    outputs: dict[str, torch.Tensor] = {}
    failed: set[str] = set()
    for _ in range(TRIES):
        for kernel, call in kernels.items():
            if kernel in failed or (kernel in best and best[kernel] > HOPELESS * min(best.values())):
                continue
            started = time.perf_counter()
            try:
                outputs[kernel] = call()
            except Exception as exc:
                if kernel == default:
                    raise
                failed.add(kernel)
                best.pop(kernel, None)
                log.warning("kernel %s failed on %s, %d rows (%s: %s); left out there", kernel, key, rows,
                            type(exc).__name__, str(exc).splitlines()[0][:120] if str(exc) else "")
                continue
            best[kernel] = min(best.get(kernel, math.inf), time.perf_counter() - started)
    name = min(best, key=best.get)
    table[choice_key] = name
    log.debug("%s, %d rows: %s (%s)", key, rows, name, ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in best.items()))
    return outputs[name]


def choose_at(rows: int) -> None:
    """Time every per-layer choice made from now on at `rows` rows (at least 1)."""
    if rows < 1:
        raise ValueError(f"--kernel-rows must be at least 1, not {rows}")
    state().timed_rows = rows


def choice_rows() -> int:
    """The rows per-layer choices are timed at (`choose_at`)."""
    return state().timed_rows


# The forward running now (torch thread) gathers rows of several sessions; True: decode and
# verify rows alone, none at position 0 (`gathered(decode_rows=True)`).
_GATHERED: list[bool] = []


@contextmanager
def gathered(decode_rows: bool = False) -> Iterator[None]:
    """Within: the rows of a layer's call come from several sessions' calls (a batched forward
    under load, not --batch-invariant). Their bits need not be what each session alone would
    get, so `pick_per_layer` takes the kernel timed fastest for the call's row bucket among
    all the layer offers, as vLLM and SGLang batch by default: rows of other sessions may move
    a session's rounding at near-ties. `decode_rows`: every row is a decode or verify row past
    position 0, so a layer may also take the kernels that keep fewer bits of a row than its
    exact calls need (`pick_per_layer`'s `decode_rows_only`): the gate/up projections' 8-bit pass,
    whose error on such rows is the attention sink's to make (docs/batching.md)."""
    _GATHERED.append(decode_rows)
    try:
        yield
    finally:
        _GATHERED.pop()


def pick_per_layer(key: tuple, x: torch.Tensor, own_name: str, own: Callable[[torch.Tensor], torch.Tensor],
                   accel: list[tuple[Backend, object]],
                   decode_rows_only: list[tuple[Backend, object]] = ()) -> torch.Tensor:
    """own(x), or one of the per-row kernels `accel` ([(backend, its weight)]) for a layer
    whose rows must come out the same in any call: one choice for every call
    (`pick(..., per_layer=True)`), made on the first and timed at `choose_at`'s rows
    (one by default, a decode step's call: the one a request makes most), whatever rows
    that first call has (a 200-token prompt's prefill chunk, or a warm-up's few rows,
    would otherwise decide: on the AVX2 EPYC they chose kernels that decode 1.5x
    slower); the output in x's dtype. `decode_rows_only`: kernels keeping fewer bits of a
    row than the layer's calls need, offered beside `accel` to gathered decode rows alone
    (`gathered(decode_rows=True)`), chosen under a key of their own."""
    if not accel and not decode_rows_only:
        return own(x)

    def calls(x: torch.Tensor, offered: list[tuple[Backend, object]]) -> dict[str, Callable[[], torch.Tensor]]:
        def run(backend: Backend, weight: object) -> torch.Tensor:
            if isinstance(weight, Deferred):
                weight = weight.state
                if weight is None:   # not made yet, or failed its check: the layer's own kernel
                    return own(x)
            return backend.run(weight, x).to(x.dtype)
        return {own_name: lambda: own(x), **{b.name: (lambda b=b, s=s: run(b, s)) for b, s in offered}}
    rows, timed_rows = x.shape[0], state().timed_rows
    if _GATHERED:   # several sessions' rows: the fastest kernel for this bucket (`gathered`)
        if _GATHERED[-1] and decode_rows_only:
            return pick((*key, "gathered-decode"), rows, calls(x, [*accel, *decode_rows_only]))
        return pick((*key, "gathered"), rows, calls(x, accel))
    if not accel:
        return own(x)
    if rows != timed_rows and (*key, 0) not in state().choices:
        probe = x[torch.arange(timed_rows) % rows]      # the first call's rows, as many as the choice is timed at
        pick(key, timed_rows, calls(probe, accel), per_layer=True)
    return pick(key, rows, calls(x, accel), per_layer=True)


def saved_choices() -> dict[tuple, str]:
    """Every choice made so far, to be restored at a later start (`restore_choices`)."""
    return dict(state().choices)


def restore_choices(choices: dict[tuple, str]) -> None:
    """Start from these choices (a start profile's), or from none: `pick` times only
    what they do not hold, and a kernel they name that this process lacks is timed
    against the others again. A layer whose choices they hold prepares only the
    backends they name (`wanted`): a layer's other kernels' weights (an int8 copy of
    an int4 weight, 0.3 s a gate/up layer of the 1.5B) are not made at all."""
    now = state()
    now.choices.clear()
    now.choices.update(choices)
    now.named.clear()
    for choice_key, name in choices.items():
        now.named.setdefault(tuple(choice_key[:3]), set()).add(name)


def gathered_only(key: tuple, backend: str) -> bool:
    """Whether restored choices name `backend` for a layer of `key` only in batches of
    several sessions' rows: its weight can wait until the service serves (`Deferred`)."""
    if backend not in state().named.get(tuple(key[:3]), ()):
        return False
    return all(len(k) > 3 and k[3] == "gathered" for k, name in state().choices.items()
               if name == backend and tuple(k[:3]) == tuple(key[:3]))


class Deferred:
    """A kernel's weight for one layer, made later: restored choices name its kernel for
    batches of several sessions only (a gate/up layer's int8 copy for fbgemm, 0.3 s each
    for the 1.5B: 13 s of a restart), which no request needs before the service serves.
    Until `prepare` has run (or where the kernel failed its check), calls that would take
    it run the layer's own kernel instead: the same output within its tolerance, slower."""

    def __init__(self, make: Callable[[], object]):
        self._make: Callable[[], object] | None = make
        self.state: object = None

    def prepare(self) -> None:
        make, self._make = self._make, None   # dropped once made: it holds what the weight is made from
        if make is not None:
            self.state = make()


def prepare_deferred(run: Callable[[Callable[[], None]], None], kernel_state: KernelState | None = None,
                     limit: int | None = None) -> int:
    """Make the deferred weights of `kernel_state` (the state in force), at most `limit` (None:
    all), each through `run` (the torch thread's, one layer a call, so forwards go between
    them); how many."""
    pending = (kernel_state or state()).deferred
    done = 0
    while pending and (limit is None or done < limit):
        run(pending[0].prepare)
        if pending:          # (unless cleared meanwhile)
            pending.pop(0)   # after it is made: `pending` counts what batches still wait for (Info)
        done += 1
    return done


def wanted(key: tuple, backend: str) -> bool:
    """Whether a layer of `key` ((kind, out, in)) should prepare `backend`: unless
    restored choices cover the layer and none names the backend."""
    named = state().named.get(tuple(key[:3]))
    return named is None or backend in named


def choices() -> list[str]:
    """What `pick` chose so far, one line per layer shape and row bucket."""
    return [f"{' '.join(str(k) for k in key[:-1])} {f'rows<={key[-1]}' if key[-1] else 'every call'}: {name}"
            for key, name in sorted(
        state().choices.items(), key=lambda item: (tuple(str(k) for k in item[0][:-1]), item[0][-1]))]
