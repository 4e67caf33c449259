"""`specdec up`'s standby: its imports at the lowest CPU priority (where that can be undone),
back at the process's own once the restart's line comes, and the service served at it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

from specdec_tools.standby import IDLE_NICE, reversible_nice

# A service module whose import stands for torch's: it starts a worker thread (a kernel
# library's OpenMP pool), records its thread's priority, and waits to be let go.
SERVICE_MAIN = textwrap.dedent("""
    import json, os, pathlib, threading, time
    out = pathlib.Path(os.environ["STANDBY_TEST_DIR"])
    nice = lambda tid=0: os.getpriority(os.PRIO_PROCESS, tid)
    worker_started = threading.Event()
    worker_tid = []
    def worker():
        worker_tid.append(threading.get_native_id())
        worker_started.set()
        time.sleep(3600)
    threading.Thread(target=worker, daemon=True).start()
    worker_started.wait()
    (out / "importing").write_text(json.dumps(nice()))
    deadline = time.monotonic() + 60
    while not (out / "release").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    (out / "released").write_text(json.dumps(nice()))

    def main(args):
        (out / "served").write_text(json.dumps({"args": args, "nice": nice(), "worker": nice(worker_tid[0])}))
""")


def fake_service(tmp_path, main_source: str) -> dict[str, str]:
    """A package `fake_service` under tmp_path whose __main__ is `main_source`; the environment
    that imports it."""
    package = tmp_path / "fake_service"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "__main__.py").write_text(main_source)
    return {**os.environ, "STANDBY_TEST_DIR": str(tmp_path),
            "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}


def test_a_standby_imports_at_idle_priority_and_serves_at_its_own(tmp_path):
    env = fake_service(tmp_path, SERVICE_MAIN)
    base = os.getpriority(os.PRIO_PROCESS, 0)
    standby = subprocess.Popen([sys.executable, "-m", "specdec_tools.standby", "fake_service"], stdin=subprocess.PIPE,
                               text=True, env=env)
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "importing").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        during = json.loads((tmp_path / "importing").read_text())
        # The restart's line comes while the imports still run: they finish at the process's priority.
        standby.stdin.write(json.dumps(["--port", "0"]) + "\n")
        standby.stdin.flush()
        time.sleep(0.2)
        (tmp_path / "release").write_text("")
        assert standby.wait(30) == 0
    finally:
        standby.kill()
    released = json.loads((tmp_path / "released").read_text())
    served = json.loads((tmp_path / "served").read_text())
    assert served["args"] == ["--port", "0"]
    if reversible_nice(IDLE_NICE) and base < IDLE_NICE:
        assert during == IDLE_NICE      # the imports yield the cores to the serving services
    else:                               # lowering it could not be undone here: never lowered
        assert during == base
    assert released == base
    # The service runs at the process's priority, and so does the thread its imports started.
    assert served["nice"] == base and served["worker"] == base


def test_a_standby_told_nothing_ends_without_serving(tmp_path):
    env = fake_service(tmp_path, "def main(args):\n    raise SystemExit(3)\n")
    result = subprocess.run([sys.executable, "-m", "specdec_tools.standby", "fake_service"], input="\n", text=True,
                            env=env, timeout=30)
    assert result.returncode == 0
