"""What differs between the devices a model runs on, in one place: a `DevicePolicy`,
chosen once when the model loads (`LoadedModel.policy`, or `policy(device)` for a
tensor's) and read by the code that runs it, instead of device checks of its own.

- The CPU runs a kernel when it is called, so a host clock times it, and which
  kernel a call takes (the int4 kernel or a dense matmul, bmm or fused attention,
  llama.cpp's graph or torch's ops) is chosen by timing them here: at warm-up, and
  at a new shape's first call. Keys and values are kept in fp32, and a
  verification's rows attend as its decode steps did, to the bit (both cheap here).
  A converted model (int8, int4, q4_0) is kept in the model cache, as converting it
  again takes seconds to minutes. Memory is the machine's, or a container's limit.
- A GPU runs kernels after their launch returns: a clock synchronizes first (a
  service's forwards are timed by CUDA events, read once the device passed them;
  StartSession waits for a `DeviceMark` after its prefill), and
  host timing cannot choose between kernels, so its paths are fixed (fused
  attention, the static step). The static step's inputs are staged in pinned memory
  and each row bucket replays a CUDA graph; a session's steps are fed their tokens on
  the device: a draft's round (greedy, or sampled without penalties) is read once,
  target-only decoding a step behind the queue (`HostCopy`). Memory is the GPU's free memory.
"""
from __future__ import annotations

import functools
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import psutil
import torch

CGROUP_MEMORY = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),                  # v2
                 ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"))


@dataclass(frozen=True)
class DevicePolicy:
    device: torch.device

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    @property
    def timed_kernels(self) -> bool:
        """Whether kernel choices are made by timing them on the host (the CPU's)."""
        return self.device.type == "cpu"

    @property
    def exact_rows(self) -> bool:
        """Whether a verification's rows attend one at a time, as its decode steps did (the
        CPU's kernels then give the decode steps' bits; on a GPU it would cost a launch a row)."""
        return self.device.type == "cpu"

    @property
    def keeps_converted(self) -> bool:
        """Whether a quantized model is kept converted in the model cache: the CPU's
        kernels' packed layouts take seconds to minutes to make; a GPU's are made at load."""
        return self.device.type == "cpu"

    @property
    def chains_steps(self) -> bool:
        """Whether a session's steps feed each token from the device, so the host queues a step
        before it reads the token before it (a read waits for the GPU's queue to drain): the
        drafter reads a round's tokens once (greedy, or sampled without penalties: drawn on the
        device), target-only decoding reads each token a step behind. The CPU keeps the
        step-by-step loops: nothing runs while the host reads, and the drafter's confidence
        rule there saves the steps it cuts."""
        return self.on_gpu

    @property
    def graphs(self) -> bool:
        """CUDA graphs of the static step, a row bucket each; inputs staged in pinned memory."""
        return self.on_gpu

    def cache_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The KV cache's dtype for weights in `dtype`. On the CPU fp32 whatever the weights:
        attention then scores and sums in fp32 (as a fused kernel accumulates) without
        converting the cache each step; bf16 scores measured 7x the KL of the transformers
        forward against fp32 on the 1.5B, for twice the memory (57 KB a token for the 1.5B)."""
        return torch.float32 if self.device.type == "cpu" else dtype

    def clock(self) -> Callable[[], float]:
        """time.perf_counter, after the device's queued work is done: a GPU runs kernels
        after their launch returns, so an unsynchronized clock reads launch time."""
        if not self.on_gpu:
            return time.perf_counter
        device = self.device

        def synchronized() -> float:
            torch.cuda.synchronize(device)
            return time.perf_counter()
        return synchronized

    def mark(self) -> "DeviceMark":
        """A mark after the work this thread has queued on the device (`DeviceMark`)."""
        return DeviceMark(self.device)

    def forward_timer(self) -> "HostTimer | EventTimer":
        """What times a service's forwards as they run (its live cost curve): the host's clock
        on the CPU, CUDA events on a GPU, where the host's clock reads a forward's launch."""
        return EventTimer() if self.on_gpu else HostTimer()

    def free_bytes(self) -> int:
        """Bytes this process can still take: a GPU's free memory; else the machine's
        available memory, or less under a cgroup limit (a container's: psutil sees the
        host's memory there)."""
        if self.on_gpu:
            return torch.cuda.mem_get_info(self.device)[0]
        available = psutil.virtual_memory().available
        for limit_file, usage_file in CGROUP_MEMORY:
            try:
                limit = open(limit_file).read().strip()
                usage = int(open(usage_file).read().strip())
            except (OSError, ValueError):
                continue
            if limit.isdigit() and int(limit) < 2**60:  # "max", or v1's huge number: no limit
                available = min(available, max(int(limit) - usage, 0))
            break
        return available


@functools.lru_cache(maxsize=None)
def policy(device: torch.device | str) -> DevicePolicy:
    return DevicePolicy(torch.device(device))


class DeviceMark:
    """A mark in a GPU's queue after the work this thread has queued so far: `wait` returns once
    the device has done that work, and blocks only its caller (the work queued after the mark
    goes on; torch releases the GIL while it waits). On the CPU the work is done when queued."""

    def __init__(self, device: torch.device):
        self.event: torch.cuda.Event | None = None
        if device.type == "cuda":
            self.event = torch.cuda.Event()
            self.event.record()

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()


class HostCopy:
    """A device tensor's values on their way to the host. On a GPU the copy is queued now, into
    pinned memory, behind the work that computes them, with a mark after it: `tolist` then
    waits for that work alone, while the steps queued after it run (a plain read waits for the
    whole queue). On the CPU the values are already there."""

    def __init__(self, values: torch.Tensor):
        device = values.device
        if device.type == "cuda":
            # The caching host allocator hands back a pinned block it holds: no cudaHostAlloc a step.
            pinned = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            values = pinned.copy_(values, non_blocking=True)
        self.values, self.done = values, DeviceMark(device)

    def tolist(self):
        self.done.wait()
        return self.values.tolist()


class HostTimer:
    """The CPU's forwards run inside their calls: the host's clock around one is its time."""

    def start(self) -> float:
        return time.perf_counter()

    def stop(self, started: float, what: Any) -> list[tuple[Any, float]]:
        """[(what, ms)]: this forward's time, known at once."""
        return [(what, (time.perf_counter() - started) * 1e3)]


class EventTimer:
    """A GPU's forwards run after their calls return: the host's clock around one reads its
    launch (a CUDA graph's replay: a tenth of a millisecond, whatever the model), and a clock
    that synchronized would stall the chained steps. A pair of CUDA events around each forward
    reads its time on the device instead, once the device has passed the pair (`query`: no
    wait), so each time arrives a forward or more late. Pairs the device has not passed within
    `keep` later forwards are dropped unread rather than waited for."""

    def __init__(self, event: Callable[[], Any] = lambda: torch.cuda.Event(enable_timing=True), keep: int = 64):
        self._event = event
        self._pending: deque = deque(maxlen=keep)   # (start, end, what), oldest first

    def start(self):
        event = self._event()
        event.record()
        return event

    def stop(self, started, what: Any) -> list[tuple[Any, float]]:
        """[(what, ms)] of every forward the device has finished since the last call, in order."""
        end = self._event()
        end.record()
        self._pending.append((started, end, what))
        done = []
        while self._pending and self._pending[0][1].query():
            begun, ended, forward = self._pending.popleft()
            done.append((forward, begun.elapsed_time(ended)))
        return done
