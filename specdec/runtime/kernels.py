"""Which kernel computes a quantized layer's call, chosen by timing.

A layer offers every kernel that can compute it from the weight it holds:
torch's own always, and the accelerated backends registered here for its weight
format, where their package installs and their result matches torch's on the
layer (a backend that does not import, or fails its check, is skipped with a
log line, never an error). Which of them runs a call is kernel_choices' (timed
in the forward itself, per layer shape and row bucket). Which kernel wins depends on the CPU
(AVX2, AVX-512 VNNI, AMX), the shape and the rows: benchmarks/kernel_bench.py
measures them side by side.
"""
from __future__ import annotations

import functools
import importlib
import logging
import math
import threading
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from specdec.runtime import kernel_choices
from specdec.runtime.kernel_choices import wanted

log = logging.getLogger(__name__)
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
# Whether each registered backend imports and runs here (keyed by the backend: one
# registered again, say by a test, is asked again).
_usable: dict[Backend, bool] = {}
_lock = threading.Lock()


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
            if backend not in _usable:
                missing = [flag for flag in backend.cpu_flags if flag not in cpu_flags()]
                if missing:
                    _usable[backend] = False
                    log.info("kernel backend %s skipped: this CPU lacks %s, which its kernels need", backend.name,
                             ", ".join(missing))
                    continue
                try:
                    importlib.import_module(backend.module)
                    if backend.selftest is not None:
                        backend.selftest()
                    _usable[backend] = True
                    log.info("kernel backend %s is available (%s)", backend.name, backend.module)
                except Exception as exc:  # not installed, or built for another torch or CPU
                    _usable[backend] = False
                    log.info("kernel backend %s skipped: %s does not import or run here (%s: %s)", backend.name,
                             backend.module, type(exc).__name__, str(exc).splitlines()[0][:120] if str(exc) else "")
        if _usable[backend]:
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
    failed = kernel_choices.state().failed
    with _lock:
        said = shape in failed
        failed.add(shape)
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
    made = functools.cache(weight if callable(weight) else lambda: weight)

    def check(backend: Backend) -> object | None:
        the_weight = made()
        state = checked(backend, the_weight, reference, in_features or the_weight[0].shape[1],
                        states.get(backend.shares))
        if state is not None:
            states[backend.name] = state
        return state
    for backend in backends:
        if kernel_choices.gathered_only(key, backend.name):   # made once the service serves
            later = kernel_choices.Deferred(lambda backend=backend: check(backend))
            kernel_choices.state().deferred.append(later)
            out.append((backend, later))
        elif (state := check(backend)) is not None:
            out.append((backend, state))
    return out


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
