"""The device policy (specdec/runtime/device.py): what running on a device means for
the code that runs it, decided in one place. No GPU here: its driver is the boundary."""
from __future__ import annotations

import torch

from specdec.runtime import device as device_module
from specdec.runtime.device import policy


def test_a_gpus_clock_waits_for_its_queued_kernels_and_the_cpus_does_not(monkeypatch):
    synchronized = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synchronized.append(device))
    policy("cpu").clock()()
    assert synchronized == []
    policy("cuda:1").clock()()
    assert synchronized == [torch.device("cuda", 1)]


def test_free_memory_on_the_cpu_is_a_containers_limit_less_its_usage_where_lower(monkeypatch, tmp_path):
    limit, usage = tmp_path / "memory.max", tmp_path / "memory.current"
    limit.write_text(f"{3 << 30}\n")
    usage.write_text(f"{1 << 30}\n")
    monkeypatch.setattr(device_module, "CGROUP_MEMORY", ((str(limit), str(usage)),))
    assert policy("cpu").free_bytes() == min(2 << 30, device_module.psutil.virtual_memory().available)
    limit.write_text("max\n")   # no limit: the machine's
    assert policy("cpu").free_bytes() > 0 and policy("cpu").free_bytes() != 2 << 30


def test_the_kv_cache_is_fp32_on_the_cpu_whatever_the_weights():
    from specdec.runtime.models import load_model
    loaded = load_model("tiny-target", dtype="bf16")
    assert loaded.lean.dtype == torch.bfloat16 and loaded.lean.new_cache().buffer.dtype == torch.float32
    assert policy("cuda").cache_dtype(torch.bfloat16) == torch.bfloat16   # a GPU's attention kernels accumulate in fp32
