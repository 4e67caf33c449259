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
"""
from __future__ import annotations

import ctypes
import functools
import os
import subprocess
import sys
import threading
import weakref

import torch

CHUNK_ROWS = 4
SELFTEST_TIMEOUT_S = 120
_F32 = 0  # ggml_type of float32


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


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


@functools.cache
def lib() -> _Lib:
    return _Lib()


_scratch: dict[tuple[int, int], torch.Tensor] = {}   # (rows, width) -> fp32 [rows, width]: x and y of the calls
_lock = threading.Lock()


def _buffer(rows: int, width: int) -> torch.Tensor:
    # One x and one y per shape for every layer: a process's forwards run one at a time
    # (specdec.runtime.torch_thread), and each call copies its output out before the next.
    # Made outside inference mode whoever asks first: an inference tensor may not be
    # written by a call outside it (a test's, a script's).
    with _lock, torch.inference_mode(False):
        return _scratch.setdefault((rows, width), torch.zeros(rows, width))


def aligned(t: torch.Tensor) -> torch.Tensor:
    """t, contiguous, or a copy whose data starts on 64 bytes (ggml wants its tensors' data aligned)."""
    t = t.contiguous()
    if t.data_ptr() % 64 == 0:
        return t
    nbytes = t.numel() * t.element_size()
    raw = torch.empty(nbytes + 64, dtype=torch.uint8)
    offset = -raw.data_ptr() % 64
    return raw[offset:offset + nbytes].view(t.dtype).view(t.shape).copy_(t)


def place(tensor, memory: torch.Tensor):
    """Put `tensor` (of a no_alloc context) over this process's `memory`; returns the buffer to free."""
    g = lib()
    buffer = g.buffer_from_ptr(memory.data_ptr(), memory.numel() * memory.element_size())
    if g.tensor_alloc(buffer, tensor, memory.data_ptr()) != 0:
        g.buffer_free(buffer)
        raise RuntimeError("ggml could not place a tensor in this process's memory")
    return buffer


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
        self.buffers = [place(tensor, memory) for tensor, memory in ((w, weight.blocks), (x, self.x), (y, self.y))]
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
    in fp32 either way; a decode step's few rows convert once, on the copy out)."""

    def __init__(self, blocks: torch.Tensor, ggml_type: int, in_features: int):
        assert blocks.dtype == torch.uint8 and blocks.dim() == 2, (blocks.dtype, blocks.shape)
        self.blocks = aligned(blocks)
        self.ggml_type, self.in_features, self.out_features = int(ggml_type), int(in_features), blocks.shape[0]
        self.nbytes = self.blocks.numel()
        self._graphs: dict[int, _Graph] = {}

    def _graph(self, rows: int) -> _Graph:
        graph = self._graphs.get(rows)
        if graph is None:
            graph = self._graphs[rows] = _Graph(self, rows)
        return graph

    def __call__(self, x: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        follow_threads()
        rows = x.shape[0]
        if rows <= CHUNK_ROWS:
            return self._graph(rows)(x, dtype)
        return torch.cat([self._graph(min(CHUNK_ROWS, rows - start))(x[start:start + CHUNK_ROWS], dtype)
                          for start in range(0, rows, CHUNK_ROWS)])

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
    as AMX) ends the process with SIGILL, which must not be a model service's."""
    try:
        done = subprocess.run([sys.executable, "-c", _SELFTEST], capture_output=True, text=True,
                              timeout=SELFTEST_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"a probe matmul did not finish in {SELFTEST_TIMEOUT_S} s") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1][:160]
        raise RuntimeError(f"a probe matmul in a child process ended with code {done.returncode} ({last})")
