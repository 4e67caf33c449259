"""ggml's CPU matmuls (llama.cpp's kernels) over a GGUF tensor's own blocks.

llama-cpp-python (`pip install ".[llama-cpp]"`) ships ggml as shared libraries;
this binds, through ctypes, the few functions one matmul needs: a context
holding three tensor headers (the weight, x, y) whose data are memory this
process owns, a one-node graph, and the CPU backend that computes it. The weight
stays in the GGUF's blocks (Q4_K, Q6_K, Q4_1, ...), never re-rounded; ggml
quantizes each row of x to 8 bits per block of 256 (Q8_K) or 32 and runs its
integer dot products, the arithmetic llama.cpp decodes with. On an AVX2 EPYC a
Q4_K 8960 x 1536 weight took 0.29 ms for one row (torch's int4 kernel about 1.0).

Each row of x is computed alone for a few rows at a time: below 8 rows a row's
output is the same bits in any call (measured); from 8 rows ggml takes another
path. So a call runs in chunks of at most CHUNK_ROWS rows, and `prepare` checks
that a chunk's rows match one-row calls bit for bit before the layer may use it.

ggml can also lay a Q4_K or Q4_0 weight out as llama.cpp loads it, 8 rows
interleaved (its CPU "repack" buffer): `place_repacked`. Its GEMV, one row at a
time, is the faster one-row kernel (0.174 against 0.243 ms for a Q4_K 8960 x 1536
on an AVX-512 EPYC), but from 4 rows ggml runs a GEMM whose rows are other bits:
a call over repacked weights stays under REPACK_ROWS rows.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os
import subprocess
import sys
import threading
import weakref

import torch

from specdec.runtime import probe_cache

CHUNK_ROWS = 4
REPACK_ROWS = 3       # ggml's repacked mul_mat: a GEMV a row below 4 rows, a GEMM from 4
SELFTEST_TIMEOUT_S = 120
_F32 = 0  # ggml_type of float32
Q4_0, Q4_K = 2, 12
# The ggml types laid out in the repack buffer, each where its probe passes (`repack_usable`):
# ggml has layouts for some types on some CPUs only (Q6_K's and Q8_0's ended the process on an
# x86 one), so only these, probed.
REPACK_TYPES = (Q4_0, Q4_K)


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


_LOG_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
_GGML_WARN, _GGML_ERROR = 2, 3   # enum ggml_log_level


def _ggml_log(level: int, text: bytes, _user) -> None:
    if level in (_GGML_WARN, _GGML_ERROR) and text:
        logging.getLogger(__name__).log(logging.WARNING if level == _GGML_WARN else logging.ERROR, "ggml: %s",
                                        text.decode(errors="replace").rstrip())


class _Lib:
    """The ggml functions a matmul needs, bound once per process."""

    def __init__(self):
        import llama_cpp
        folder = os.path.join(os.path.dirname(llama_cpp.__file__), "lib")
        base = ctypes.CDLL(os.path.join(folder, "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
        cpu = ctypes.CDLL(os.path.join(folder, "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
        self.base, self.cpu = base, cpu  # for specdec.runtime.ggml_forward's own bindings
        p, size, i64, status = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64, ctypes.c_int

        def bind(lib, name, args, result=None):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, result
            return fn
        self.init = bind(base, "ggml_init", [_InitParams], p)
        self.free = bind(base, "ggml_free", [p])
        self.tensor_overhead = bind(base, "ggml_tensor_overhead", [], size)
        self.graph_overhead = bind(base, "ggml_graph_overhead_custom", [size, ctypes.c_bool], size)
        self.new_tensor_2d = bind(base, "ggml_new_tensor_2d", [p, ctypes.c_int, i64, i64], p)
        self.mul_mat = bind(base, "ggml_mul_mat", [p, p, p], p)
        self.new_graph = bind(base, "ggml_new_graph_custom", [p, size, ctypes.c_bool], p)
        self.build_forward = bind(base, "ggml_build_forward_expand", [p, p])
        self.tensor_alloc = bind(base, "ggml_backend_tensor_alloc", [p, p, p], status)
        self.buffer_free = bind(base, "ggml_backend_buffer_free", [p])
        self.compute = bind(base, "ggml_backend_graph_compute", [p, p], status)
        lib = base if hasattr(base, "ggml_backend_cpu_buffer_from_ptr") else cpu
        self.buffer_from_ptr = bind(lib, "ggml_backend_cpu_buffer_from_ptr", [p, size], p)
        self.backend = bind(cpu, "ggml_backend_cpu_init", [], p)()
        self.set_threads = bind(cpu, "ggml_backend_cpu_set_n_threads", [p, ctypes.c_int])
        self.threads = 0
        # The repack buffer, found as llama.cpp finds it: the CPU device's extra buffer types.
        self.cpu_reg = bind(cpu, "ggml_backend_cpu_reg", [], p)
        self.proc_address = bind(base, "ggml_backend_reg_get_proc_address", [p, ctypes.c_char_p], p)
        self.reg_dev_get = bind(base, "ggml_backend_reg_dev_get", [p, size], p)
        self.buft_name = bind(base, "ggml_backend_buft_name", [p], ctypes.c_char_p)
        self.buft_alloc = bind(base, "ggml_backend_buft_alloc_buffer", [p, size], p)
        self.buft_alloc_size = bind(base, "ggml_backend_buft_get_alloc_size", [p, p], size)
        self.buffer_base = bind(base, "ggml_backend_buffer_get_base", [p], p)
        self.tensor_set = bind(base, "ggml_backend_tensor_set", [p, p, size, size])
        # ggml prints every line to stderr, its debug ones too (one per repacked tensor): its
        # warnings and errors go to this module's log instead, the rest nowhere.
        self._log_lines = _LOG_CALLBACK(_ggml_log)
        bind(base, "ggml_log_set", [_LOG_CALLBACK, p])(self._log_lines, None)

    @functools.cached_property
    def repack_type(self):
        """The CPU backend's buffer type that repacks weights ("CPU_REPACK"), or None."""
        address = self.proc_address(self.cpu_reg(), b"ggml_backend_dev_get_extra_bufts")
        if not address:
            return None
        types = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)(address)(
            self.reg_dev_get(self.cpu_reg(), 0))
        i = 0
        while types and types[i]:
            if self.buft_name(types[i]) == b"CPU_REPACK":
                return types[i]
            i += 1
        return None


@functools.cache
def lib() -> _Lib:
    return _Lib()


# ggml_cpu_has_<name>: what the library was compiled for (llama-cpp-python builds for the machine it
# builds on), the x86 features that pick its kernels.
ISA_FEATURES = ("sse3", "avx", "avx2", "fma", "f16c", "avx_vnni", "avx512", "avx512_vbmi", "avx512_vnni",
                "avx512_bf16", "amx_int8")


@functools.cache
def isa() -> str:
    """The features the installed ggml was built for, as its ggml_cpu_has_* functions
    answer ("" where it is not installed or does not load); found without importing
    llama_cpp. A start profile is kept per this (start_profile.profile_key): one timed on
    a build with AVX-512 is not reused on a build without it, at the same version."""
    import importlib.util
    try:
        spec = importlib.util.find_spec("llama_cpp")
        if spec is None or spec.origin is None:
            return ""
        folder = os.path.join(os.path.dirname(spec.origin), "lib")
        ctypes.CDLL(os.path.join(folder, "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
        cpu = ctypes.CDLL(os.path.join(folder, "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
    except (OSError, ImportError, ValueError) as error:
        _log.info("ggml's ISA unknown (%s)", error)
        return ""
    has = []
    for name in ISA_FEATURES:
        fn = getattr(cpu, f"ggml_cpu_has_{name}", None)
        if fn is not None:
            fn.argtypes, fn.restype = [], ctypes.c_int
            if fn():
                has.append(name)
    return " ".join(has) or "none"


_scratch: dict[tuple[int, int], torch.Tensor] = {}   # (rows, width) -> fp32 [rows, width]: x and y of the calls
_lock = threading.Lock()
_log = logging.getLogger(__name__)


def _buffer(rows: int, width: int) -> torch.Tensor:
    # One x and one y per shape for every layer: a process's forwards run one at a time
    # (specdec.runtime.torch_thread), and each call copies its output out before the next.
    # Made outside inference mode whoever asks first: an inference tensor may not be
    # written by a call outside it (a test's, a script's).
    with _lock, torch.inference_mode(False):
        return _scratch.setdefault((rows, width), torch.zeros(rows, width))


ALIGNMENT = 64  # ggml asserts 32 (TENSOR_ALIGNMENT) on a buffer it is handed, and aborts the process


def aligned(t: torch.Tensor) -> torch.Tensor:
    """t, contiguous, or a copy whose data starts on ALIGNMENT bytes. Tensors transformers
    loads from safetensors may sit at any offset of the file's memory (a norm's weight
    started 40 bytes past a 64-byte line), so whatever ggml reads goes through here."""
    t = t.contiguous()
    if t.data_ptr() % ALIGNMENT == 0:
        return t
    nbytes = t.numel() * t.element_size()
    raw = torch.empty(nbytes + ALIGNMENT, dtype=torch.uint8)
    offset = -raw.data_ptr() % ALIGNMENT
    return raw[offset:offset + nbytes].view(t.dtype).view(t.shape).copy_(t)


def place(tensor, memory: torch.Tensor):
    """Put `tensor` (of a no_alloc context) over this process's `memory`; returns the buffer to free.
    Memory ggml writes (a KV cache) cannot be copied to align it: misaligned memory is refused
    here with an exception, where ggml would abort the process."""
    if memory.data_ptr() % ALIGNMENT:
        raise RuntimeError(f"memory handed to ggml must start on {ALIGNMENT} bytes; a {tuple(memory.shape)} "
                           f"{memory.dtype} tensor starts {memory.data_ptr() % ALIGNMENT} bytes past (use aligned())")
    g = lib()
    buffer = g.buffer_from_ptr(memory.data_ptr(), memory.numel() * memory.element_size())
    if g.tensor_alloc(buffer, tensor, memory.data_ptr()) != 0:
        g.buffer_free(buffer)
        raise RuntimeError("ggml could not place a tensor in this process's memory")
    return buffer


def place_repacked(tensor, blocks: torch.Tensor):
    """Put `tensor` (of a no_alloc context, a REPACK_TYPES weight of rows a multiple of 8) in a
    buffer of its own that ggml fills from `blocks`, laid out for its repacked kernels; returns
    the buffer to free. Call only where `repack_usable` passed."""
    g = lib()
    buffer = g.buft_alloc(g.repack_type, g.buft_alloc_size(g.repack_type, tensor))
    if not buffer:
        raise RuntimeError("ggml could not allocate a repack buffer")
    if g.tensor_alloc(buffer, tensor, g.buffer_base(buffer)) != 0:
        g.buffer_free(buffer)
        raise RuntimeError("ggml could not place a tensor in a repack buffer")
    g.tensor_set(tensor, blocks.data_ptr(), 0, blocks.numel() * blocks.element_size())
    return buffer


def repackable(ggml_type: int, out_features: int) -> bool:
    """Whether a weight of this type and rows may be laid out for ggml's repacked kernels here."""
    return ggml_type in REPACK_TYPES and out_features % 8 == 0 and repack_usable(ggml_type)


def follow_threads() -> None:
    """ggml's CPU backend on as many threads as torch's (set once, changed when torch's is)."""
    g = lib()
    threads = torch.get_num_threads()
    if g.threads != threads:
        g.set_threads(g.backend, threads)
        g.threads = threads


class _Graph:
    """y [rows, N] = x [rows, K] W^T for one row count, built once."""

    def __init__(self, weight: "GgmlLinear", rows: int):
        g = lib()
        self.x, self.y = _buffer(rows, weight.in_features), _buffer(rows, weight.out_features)
        self.ctx = g.init(_InitParams(3 * g.tensor_overhead() + g.graph_overhead(4, False) + 1024, None, True))
        w = g.new_tensor_2d(self.ctx, weight.ggml_type, weight.in_features, weight.out_features)
        x = g.new_tensor_2d(self.ctx, _F32, weight.in_features, rows)
        y = g.mul_mat(self.ctx, w, x)
        self.graph = g.new_graph(self.ctx, 4, False)
        g.build_forward(self.graph, y)
        self.buffers = [place_repacked(w, weight.blocks) if weight.repack else place(w, weight.blocks),
                        place(x, self.x), place(y, self.y)]
        weakref.finalize(self, _release, self.ctx, list(self.buffers))

    def __call__(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        g = lib()
        self.x.copy_(x)  # converted on the way in: x may be bf16
        if g.compute(g.backend, self.graph) != 0:
            raise RuntimeError("ggml's graph compute failed")
        return self.y.to(dtype, copy=True)  # out of the shared buffer, in the caller's dtype in one pass


def _release(ctx, buffers) -> None:
    g = lib()
    for buffer in buffers:
        g.buffer_free(buffer)
    g.free(ctx)


class GgmlLinear:
    """A GGUF tensor's blocks (uint8 [N, bytes per row], of ggml type `ggml_type`) as a
    matmul: __call__(x [M, K]) -> [M, N], fp32 unless `dtype` says otherwise (ggml computes
    in fp32 either way; a decode step's few rows convert once, on the copy out). With `repack`
    (where `repackable`), ggml holds a copy laid out for its repacked kernels."""

    def __init__(self, blocks: torch.Tensor, ggml_type: int, in_features: int, repack: bool = False):
        assert blocks.dtype == torch.uint8 and blocks.dim() == 2, (blocks.dtype, blocks.shape)
        self.blocks = aligned(blocks)
        self.ggml_type, self.in_features, self.out_features = int(ggml_type), int(in_features), blocks.shape[0]
        self.repack = repack
        self.chunk_rows = REPACK_ROWS if repack else CHUNK_ROWS   # rows a graph, each row computed alone
        self.nbytes = self.blocks.numel()
        self._graphs: dict[int, _Graph] = {}

    def _graph(self, rows: int) -> _Graph:
        graph = self._graphs.get(rows)
        if graph is None:
            graph = self._graphs[rows] = _Graph(self, rows)
        return graph

    def __call__(self, x: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        follow_threads()
        rows, chunk = x.shape[0], self.chunk_rows
        if rows <= chunk:
            return self._graph(rows)(x, dtype)
        return torch.cat([self._graph(min(chunk, rows - start))(x[start:start + chunk], dtype)
                          for start in range(0, rows, chunk)])

    def rows_alone(self, probe: torch.Tensor) -> bool:
        """Whether each row of a call of 2..CHUNK_ROWS rows comes out as it does in a one-row
        call, bit for bit."""
        alone = torch.cat([self(probe[i:i + 1]) for i in range(min(CHUNK_ROWS, probe.shape[0]))])
        return all(torch.equal(self(probe[:rows]), alone[:rows]) for rows in range(2, alone.shape[0] + 1))


_SELFTEST = """
import torch
from specdec.runtime import ggml
blocks = torch.zeros(32, 144, dtype=torch.uint8)   # Q4_K, all zero: y = 0
y = ggml.GgmlLinear(blocks, 12, 256)(torch.ones(2, 256))
assert y.shape == (2, 32) and not y.any(), y
"""


def selftest() -> None:
    """One small matmul in a child process: a ggml built for another CPU (llama-cpp-python
    compiles it for the machine that installed it; a VM may hide what it found there, such
    as AMX) ends the process with SIGILL, which must not be a model service's. Once it
    passed on this machine and build, not again (`probe_cache`)."""
    if probe_cache.passed("ggml-selftest"):
        return
    try:
        done = subprocess.run([sys.executable, "-c", _SELFTEST], capture_output=True, text=True,
                              timeout=SELFTEST_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"a probe matmul did not finish in {SELFTEST_TIMEOUT_S} s") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1][:160]
        raise RuntimeError(f"a probe matmul in a child process ended with code {done.returncode} ({last})")
    probe_cache.remember("ggml-selftest")


_REPACK_SELFTEST = """
import sys
import torch
from specdec.runtime import ggml
assert ggml.lib().repack_type, "no repack buffer type"
kind = int(sys.argv[1])
blocks, x = ggml.probe_blocks(kind, 64, 256), torch.randn(ggml.REPACK_ROWS, 256, generator=torch.Generator().manual_seed(1))
y = ggml.probe_repacked(blocks, kind, x)
one = torch.cat([ggml.probe_repacked(blocks, kind, x[i:i + 1]) for i in range(x.shape[0])])
assert torch.equal(y, one), "a row's output changed with the rows beside it"
want = ggml.GgmlLinear(blocks, kind, 256)(x)
assert float((y - want).norm() / want.norm()) < 1e-4, "repacked and plain results differ"
"""


def probe_blocks(ggml_type: int, rows: int, cols: int) -> torch.Tensor:
    """Valid random blocks of a REPACK_TYPES type, uint8 [rows, bytes per row]."""
    generator = torch.Generator().manual_seed(0)
    if ggml_type == Q4_K:   # random codes, scales and mins under small fp16 d and dmin
        blocks = torch.randint(0, 256, (rows * cols // 256, 144), dtype=torch.uint8, generator=generator)
        blocks[:, 0:4] = torch.tensor([0.01, 0.002], dtype=torch.float16).view(torch.uint8)
        return blocks.reshape(rows, -1)
    from gguf.quants import quantize
    weight = torch.randn(rows, cols, generator=generator).numpy()
    return torch.from_numpy(quantize(weight, ggml_type)).reshape(rows, -1)


def probe_repacked(blocks: torch.Tensor, ggml_type: int, x: torch.Tensor) -> torch.Tensor:
    """x [M, K] (M <= REPACK_ROWS) times the weight of `blocks` (uint8 [N, bytes per row]) repacked."""
    assert x.shape[0] <= REPACK_ROWS, x.shape
    return GgmlLinear(blocks, ggml_type, x.shape[1], repack=True)(x)


@functools.cache
def repack_usable(ggml_type: int) -> bool:
    """Whether weights of `ggml_type` may be repacked here: a probe in a child process (a layout
    ggml lacks for this CPU ends the process) gives each row the bits of a one-row call, within
    rounding of the plain kernel. Said in the log either way, once a type."""
    name = {Q4_0: "Q4_0", Q4_K: "Q4_K"}.get(ggml_type, str(ggml_type))
    if ggml_type not in REPACK_TYPES:
        return False
    if probe_cache.passed(f"ggml-repack-{ggml_type}"):
        _log.info("ggml's repacked %s kernels passed their probe here before: %s weights are laid out for them",
                  name, name)
        return True
    try:
        done = subprocess.run([sys.executable, "-c", _REPACK_SELFTEST, str(ggml_type)], capture_output=True,
                              text=True, timeout=SELFTEST_TIMEOUT_S)
        reason = None if done.returncode == 0 else (done.stderr.strip().splitlines() or ["no output"])[-1][:160]
    except subprocess.TimeoutExpired:
        reason = f"a probe did not finish in {SELFTEST_TIMEOUT_S} s"
    if reason is None:
        _log.info("ggml's repacked %s kernels pass their probe: %s weights are laid out for them", name, name)
        probe_cache.remember(f"ggml-repack-{ggml_type}")
        return True
    _log.info("ggml's repacked %s kernels are not used here: %s", name, reason)
    return False
