"""scripts/gpu_check.sh on this machine: without CUDA it says so in one line and
runs the same checks on the CPU, so the script a GPU session runs is known to work."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.integration
def test_the_gpu_check_runs_its_quick_checks_and_prints_one_table():
    result = subprocess.run([str(ROOT / "scripts" / "gpu_check.sh"), "--quick"], capture_output=True, text=True,
                            timeout=600, env={**os.environ, "PYTHON": sys.executable})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        assert result.stdout.splitlines()[0] == "gpu_check: no CUDA device here; running the same checks with --device cpu"
    table = [line for line in result.stdout.splitlines() if line.startswith("| ")]
    assert table[0].startswith(f"| check ({device}) |")
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[1] for line in table[1:]}
    assert rows == {"device": "ok", "tiny pair, greedy = target-only": "ok", "chi-square, 2000 sampled runs": "ok"}
