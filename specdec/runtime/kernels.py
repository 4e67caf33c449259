"""Which kernel computes a quantized layer's call, chosen by timing.

A layer offers every kernel that can compute it from the weight it holds:
torch's own always, and the accelerated backends registered here for its weight
format, where their package installs and their result matches torch's on the
layer (a backend that does not import, or fails its check, is skipped with a
log line, never an error). `pick` times each one on the first calls of a layer
shape and row bucket, in the forward itself (the weights as cold or warm as
serving finds them), and runs the fastest from then on; `choices()` is what it
chose, for the log and the service's Info. Which kernel wins depends on the CPU
(AVX2, AVX-512 VNNI, AMX), the shape and the rows: benchmarks/kernel_bench.py
measures them side by side.
"""
from __future__ import annotations

import functools
import importlib
import logging
import math
import threading
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

log = logging.getLogger(__name__)
TRIES = 3               # timed calls of each kernel before a bucket's choice; the fastest call counts
# A kernel that took this many times the fastest one's time is not timed again for the bucket.
# A first call's one-off costs (oneDNN building its kernel) rarely reach it, and timing a
# path that slow three times is what a service's start (model_service.time_prefill_buckets),
# or else a bucket's first request, pays: on an AVX2 CPU emulated bf16 matmuls are 4x its
# int8 kernels.
HOPELESS = 3.0
CHECK_TOLERANCE = 0.03  # a backend's output within this relative error of torch's on the layer, or it is skipped


@dataclass(frozen=True)
class Backend:
    name: str
    # The weight it computes from, and so what `prepare` takes (WEIGHT_FORMATS).
    weight_format: str
    module: str           # imported before it is used: where it does not install, the backend is skipped
    prepare: Callable[..., object]                        # (*the weight, as its format has it) -> its weight
    run: Callable[[object, torch.Tensor], torch.Tensor]   # (its weight, x [M, K]) -> [M, N]
    # Each row's output depends on that row alone (activations scaled per row), bit for bit,
    # whatever rows share the call: such a kernel can serve a layer whose decode step and
    # verification must agree exactly (`pick(..., per_layer=True)`).
    per_row: bool = False
    # How many bits of each activation row its arithmetic keeps: a layer whose input carries
    # outlier channels (the MLP down projections') asks for more than int8's 8.
    activation_bits: int = 8
    # CPU features its kernels need (as /proc/cpuinfo names them). A native library may
    # end the process on a CPU without them (zentorch's int8 GEMM dies of SIGILL on an
    # AVX2-only EPYC), so a backend is not even imported where one is missing.
    cpu_flags: tuple[str, ...] = ()
    # Run once after the import, before any layer uses it; raising leaves the backend out.
    # For a native library that may end the process where it was built for another CPU.
    selftest: Callable[[], None] | None = None
    # Another backend whose prepared weight this one runs on (its own `prepare` then only
    # where that one failed or is not offered): two arithmetics over one copy of the weight.
    shares: str = ""


# What each weight format hands a backend's `prepare`: the tensors, in order.
WEIGHT_FORMATS = {
    "int8-channel": "codes [N, K] int8 and their scales [N] fp32: w = codes * scale, per output row",
    "gguf-blocks": "a GGUF tensor's own bytes, uint8 [N, bytes per row], their ggml type (an int) and K",
}
BACKENDS: list[Backend] = []
_usable: dict[str, bool] = {}
_lock = threading.Lock()
_CHOICE: dict[tuple, str] = {}   # (*layer key, row bucket) -> the kernel chosen
_FAILED: set[tuple] = set()      # (backend, out, in): failed its check on a layer of that shape


def register(backend: Backend) -> Backend:
    BACKENDS.append(backend)
    return backend


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags, as /proc/cpuinfo lists them (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def usable(weight_format: str, per_row: bool = False, activation_bits: int = 0) -> list[Backend]:
    """The registered backends for this weight format whose CPU features this CPU has
    and whose package imports here (only those whose rows are computed independently,
    with `per_row`; only those keeping at least `activation_bits` of an activation row)."""
    out = []
    for backend in BACKENDS:
        if backend.weight_format != weight_format or (per_row and not backend.per_row) \
                or backend.activation_bits < activation_bits:
            continue
        with _lock:
            if backend.name not in _usable:
                missing = [flag for flag in backend.cpu_flags if flag not in cpu_flags()]
                if missing:
                    _usable[backend.name] = False
                    log.info("kernel backend %s skipped: this CPU lacks %s, which its kernels need", backend.name,
                             ", ".join(missing))
                    continue
                try:
                    importlib.import_module(backend.module)
                    if backend.selftest is not None:
                        backend.selftest()
                    _usable[backend.name] = True
                    log.info("kernel backend %s is available (%s)", backend.name, backend.module)
                except Exception as exc:  # not installed, or built for another torch or CPU
                    _usable[backend.name] = False
                    log.info("kernel backend %s skipped: %s does not import or run here (%s: %s)", backend.name,
                             backend.module, type(exc).__name__, str(exc).splitlines()[0][:120] if str(exc) else "")
        if _usable[backend.name]:
            out.append(backend)
    return out


def checked(backend: Backend, weight: tuple, reference: Callable[[torch.Tensor], torch.Tensor],
            in_features: int, state: object = None) -> object | None:
    """The backend's weight for this layer (`weight` in its format, [N, ...] first; or
    `state`, prepared already), if its output on a probe matches the layer's own kernel
    (`reference`); None (said once per backend and shape) if it does not."""
    out_features = weight[0].shape[0]
    try:
        state = backend.prepare(*weight) if state is None else state
        probe = torch.randn(4, in_features, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():   # a layer loaded outside inference mode holds parameters
            want = reference(probe).float()
            got = torch.as_tensor(backend.run(state, probe)).float()
        error = float((got - want).norm() / want.norm().clamp(min=1e-12))
        if math.isfinite(error) and error <= CHECK_TOLERANCE:
            return state
        reason = f"relative error {error:.3g} against torch's kernel"
    except Exception as exc:
        reason = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
    # Left out for this shape only: a kernel can be wrong for some shapes and right for others
    # (zentorch 2.13's int8 x int8 GEMM is off by several times the output from an inner size of
    # 4,096 on an AVX-512 EPYC, and exact below it), so the layers it computes rightly keep it.
    shape = (backend.name, out_features, in_features)
    with _lock:
        said = shape in _FAILED
        _FAILED.add(shape)
    if not said:
        log.warning("kernel backend %s skipped for %d x %d layers: it failed its check (%s)", backend.name,
                    out_features, in_features, reason)
    return None


def prepared(weight_format: str, weight: tuple | Callable[[], tuple], reference: Callable[[torch.Tensor], torch.Tensor],
             per_row: bool = False, activation_bits: int = 0, in_features: int | None = None,
             key: tuple = ()) -> list[tuple[Backend, object]]:
    """[(backend, its weight)] for every usable backend of this format (per-row ones
    only, with `per_row`; keeping `activation_bits`) that passes its check on this
    layer against `reference`, and that the layer's restored choices name if it has
    any (`wanted`, for the layer `key`); `weight` as WEIGHT_FORMATS[weight_format]
    lists it, or a function making it (called only if a backend is wanted), its first
    tensor [N, K] unless `in_features` says K."""
    assert weight_format in WEIGHT_FORMATS, weight_format
    out, states = [], {}
    backends = [b for b in usable(weight_format, per_row, activation_bits) if wanted(key, b.name)]
    if backends and callable(weight):
        weight = weight()
    for backend in backends:
        state = checked(backend, weight, reference, in_features or weight[0].shape[1], states.get(backend.shares))
        if state is not None:
            out.append((backend, state))
            states[backend.name] = state
    return out


def bucket(rows: int) -> int:
    """Rows alike enough to share a choice: each count up to 8 (kernels take rows
    in passes of 4 or so), then powers of two."""
    return rows if rows <= 8 else 1 << (rows - 1).bit_length()


def chosen(key: tuple, rows: int) -> str | None:
    """The kernel `pick` chose for (key, rows) (not per layer), or None before it has."""
    return _CHOICE.get((*key, bucket(rows)))


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
    default = next(iter(kernels))
    if len(kernels) == 1:
        return kernels[default]()
    choice_key = (*key, 0 if per_layer else bucket(rows))
    name = _CHOICE.get(choice_key)
    if name in kernels:
        if name == default:
            return kernels[name]()
        try:
            return kernels[name]()
        except Exception as exc:
            log.warning("kernel %s failed on %s (%s: %s); the layer's own kernel runs there from now on", name,
                        choice_key, type(exc).__name__, str(exc).splitlines()[0][:120] if str(exc) else "")
            _CHOICE[choice_key] = default
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
    _CHOICE[choice_key] = name
    log.debug("%s, %d rows: %s (%s)", key, rows, name, ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in best.items()))
    return outputs[name]


# The rows a per-layer choice is timed at (`choose_at`, the services' --kernel-rows): one, a
# decode step's call, by default; a service that batches many sessions (8 clients: forwards of
# 8 rows or more) is served better by a choice timed at its usual batch.
_CHOICE_ROWS = [1]


def choose_at(rows: int) -> None:
    """Time every per-layer choice made from now on at `rows` rows (at least 1)."""
    if rows < 1:
        raise ValueError(f"--kernel-rows must be at least 1, not {rows}")
    _CHOICE_ROWS[0] = rows


def choice_rows() -> int:
    """The rows per-layer choices are timed at (`choose_at`)."""
    return _CHOICE_ROWS[0]


_GATHERED: list[bool] = []   # the forward running now (torch thread) gathers rows of several sessions


@contextmanager
def gathered() -> Iterator[None]:
    """Within: the rows of a layer's call come from several sessions' decode and verify
    calls (a batched forward under load, not --batch-invariant). Their bits need not be
    what each session alone would get, so `pick_per_layer` takes the kernel timed fastest
    for the call's row bucket among all the layer offers, as vLLM and SGLang batch by
    default: rows of other sessions may move a session's rounding at near-ties."""
    _GATHERED.append(True)
    try:
        yield
    finally:
        _GATHERED.pop()


def pick_per_layer(key: tuple, x: torch.Tensor, own_name: str, own: Callable[[torch.Tensor], torch.Tensor],
                   accel: list[tuple[Backend, object]]) -> torch.Tensor:
    """own(x), or one of the per-row kernels `accel` ([(backend, its weight)]) for a layer
    whose rows must come out the same in any call: one choice for every call
    (`pick(..., per_layer=True)`), made on the first and timed at `choose_at`'s rows
    (one by default, a decode step's call: the one a request makes most), whatever rows
    that first call has (a 200-token prompt's prefill chunk, or a warm-up's few rows,
    would otherwise decide: on the AVX2 EPYC they chose kernels that decode 1.5x
    slower); the output in x's dtype."""
    if not accel:
        return own(x)

    def calls(x: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
        return {own_name: lambda: own(x), **{b.name: (lambda b=b, s=s: b.run(s, x).to(x.dtype)) for b, s in accel}}
    rows, timed_rows = x.shape[0], _CHOICE_ROWS[0]
    if _GATHERED:   # several sessions' rows: the fastest kernel for this bucket (`gathered`)
        return pick((*key, "gathered"), rows, calls(x))
    if rows != timed_rows and (*key, 0) not in _CHOICE:
        probe = x[torch.arange(timed_rows) % rows]      # the first call's rows, as many as the choice is timed at
        pick(key, timed_rows, calls(probe), per_layer=True)
    return pick(key, rows, calls(x), per_layer=True)


def saved_choices() -> dict[tuple, str]:
    """Every choice made so far, to be restored at a later start (`restore_choices`)."""
    return dict(_CHOICE)


def restore_choices(choices: dict[tuple, str]) -> None:
    """Start from these choices (a start profile's), or from none: `pick` times only
    what they do not hold, and a kernel they name that this process lacks is timed
    against the others again. A layer whose choices they hold prepares only the
    backends they name (`wanted`): a layer's other kernels' weights (an int8 copy of
    an int4 weight, 0.3 s a gate/up layer of the 1.5B) are not made at all."""
    _CHOICE.clear()
    _CHOICE.update(choices)
    _NAMED.clear()
    for choice_key, name in choices.items():
        _NAMED.setdefault(tuple(choice_key[:3]), set()).add(name)


_NAMED: dict[tuple, set[str]] = {}   # after restore_choices: a layer key -> the kernels its choices name


def wanted(key: tuple, backend: str) -> bool:
    """Whether a layer of `key` ((kind, out, in)) should prepare `backend`: unless
    restored choices cover the layer and none names the backend."""
    named = _NAMED.get(tuple(key[:3]))
    return named is None or backend in named


def choices() -> list[str]:
    """What `pick` chose so far, one line per layer shape and row bucket."""
    return [f"{' '.join(str(k) for k in key[:-1])} {f'rows<={key[-1]}' if key[-1] else 'every call'}: {name}"
            for key, name in sorted(
        _CHOICE.items(), key=lambda item: (tuple(str(k) for k in item[0][:-1]), item[0][-1]))]


# --- the accelerated backends ---------------------------------------------------------

@functools.cache
def reduce_range() -> bool:
    """fbgemm without VNNI accumulates pairs in int16 and can saturate; VNNI cannot."""
    return not any("vnni" in flag for flag in cpu_flags())


def fbgemm_pack(codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None):
    """fbgemm's packed weight from int8 codes [out, in] and their per-row scales [out], as they are."""
    with warnings.catch_warnings():
        # torch 2.13 flags quantized-tensor creation as deprecated; fbgemm's per-channel
        # GEMMs still need one to pack.
        warnings.simplefilter("ignore", UserWarning)
        qweight = torch._make_per_channel_quantized_tensor(
            codes.to(torch.int8).contiguous(), scales.double(), torch.zeros(codes.shape[0], dtype=torch.long), 0)
    return torch.ops.quantized.linear_prepack(qweight, bias)


@functools.cache
def _fbgemm_grid() -> tuple[int, float, int]:
    """(levels, step, zero): the fixed grid over [-1, 1] that fbgemm's activations take here
    (7 bits without VNNI), and fbgemm's code for 0 on it (rounded half to even, as fbgemm's)."""
    levels = 127 if reduce_range() else 255
    return levels, 2.0 / levels, round(levels / 2)


def _fbgemm_row_prepare(codes: torch.Tensor, scales: torch.Tensor):
    # Each output's weight times a row of ones: what the shift of a row's range takes back.
    ones = (codes.float().sum(dim=1) * scales.float()).contiguous()                  # [N]
    return fbgemm_pack(codes, scales.float(), None), ones


def _onto_unit(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row of x mapped affinely onto [-1, 1] by its own minimum and maximum: the
    mapped rows [M, K], each row's width [M, 1] and its centre [M, 1] (twice its midpoint)."""
    x = x.float()
    low, high = torch.aminmax(x, dim=1, keepdim=True)                                  # [M, 1] each
    width = (high - low).clamp_(min=1e-30)
    centre = high + low
    return (2 * x - centre).div_(width), width, centre


def _off_unit(y: torch.Tensor, width: torch.Tensor, centre: torch.Tensor, ones: torch.Tensor) -> torch.Tensor:
    """The product of the mapped rows back to x's: the map undone from the weight's row sums."""
    return y.mul_(width).addcmul_(centre, ones).mul_(0.5)


def _fbgemm_row_run(state, x: torch.Tensor) -> torch.Tensor:
    """fbgemm's int8 GEMM, made per row and finer. fbgemm's dynamic GEMM scales the
    activations by the range of the whole call, so a row's output would depend on the
    other rows; and without VNNI it keeps 7 bits of them (its int16 pair sums would
    saturate on 8), which cost the 1.5B's LM head 2% of its top-1 agreement with fp32.
    So each row is first mapped affinely onto [-1, 1] (its own minimum and maximum) and
    quantized on one fixed grid: that grid's rounding of the row ("high"), and what it
    leaves, stretched onto [-1, 1] again ("low"), go through one GEMM call as 2M rows
    (rows cost little more than one up to about 8), and come back as high + low times
    the stretch: 14 bits or so of each row, computed the same whatever shares the call.
    The affine map is undone per row from the weight's row sums (`ones`)."""
    packed, ones = state
    levels, step, zero = _fbgemm_grid()
    rows = x.shape[0]
    scaled, width, centre = _onto_unit(x)                                             # [M, K] in [-1, 1]
    coarse = torch.round(scaled / step).clamp_(-zero, levels - zero).mul_(step)       # on fbgemm's grid
    fine = (scaled - coarse).mul_(2 / step)                                           # in [-1, 1]
    y = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
        torch.cat([coarse, fine]), step, zero, packed)                                # [2M, N]
    return _off_unit(y[:rows].add_(y[rows:], alpha=step / 2), width, centre, ones)


# torch's own fbgemm (every x86 build), per row as above: the int8 x int8 GEMM for CPUs
# where no accelerated package runs. On an AVX2 EPYC it computes a 17,920 x 1,536 weight
# in 1.1 ms for one row and 1.9 for five, where torch's int4 kernel takes 1.9 and 5.4.
register(Backend("fbgemm-int8-row", "int8-channel", "torch", _fbgemm_row_prepare, _fbgemm_row_run, per_row=True,
                 activation_bits=14, cpu_flags=("avx2",)))


def _fbgemm_row8_run(state, x: torch.Tensor) -> torch.Tensor:
    """As `_fbgemm_row_run`, the coarse pass alone: each row's own 8 bits (7 without VNNI),
    one GEMM call of M rows. For the layers whose inputs hold no outlier channels
    (the LM head): as fast as fbgemm's dynamic GEMM, and a row's output still the same
    whatever shares the call."""
    packed, ones = state
    _, step, zero = _fbgemm_grid()
    scaled, width, centre = _onto_unit(x)
    y = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(scaled, step, zero, packed)
    return _off_unit(y, width, centre, ones)


register(Backend("fbgemm-int8-row8", "int8-channel", "torch", _fbgemm_row_prepare, _fbgemm_row8_run, per_row=True,
                 cpu_flags=("avx2",), shares="fbgemm-int8-row"))


# AMD's zentorch and llama.cpp's ggml: their own module, registered after torch's (this order).
from specdec.runtime import native_backends  # noqa: E402,F401
