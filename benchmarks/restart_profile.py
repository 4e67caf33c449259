"""A stack restarted while another stack loads the machine, then restarted quietly:
how long its verifier takes to SERVING each time, what it decided about its start
profile, and the speculation bound its coordinator printed.

    python benchmarks/restart_profile.py [--pair tiny] [--clients 4] [--json out.json]

Three starts of one stack (`specdec up`, its own empty start-profile directory):
clean (quiet, no profile yet), busy (another stack serving `--clients` HTTP clients
meanwhile), quiet again. Run from a checkout's root to measure that checkout's code.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime

import httpx

STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) verifier ")


def up(pair: str, home: str, port: int, http_port: int) -> subprocess.Popen:
    """`specdec up` of this checkout (run as a module from its root), keeping `home`'s profiles."""
    return subprocess.Popen([sys.executable, "-u", "-m", "specdec_tools.cli", "up", "--pair", pair, "--port", str(port),
                             "--http-port", str(http_port), "--no-standby"],
                            env=dict(os.environ, SPECDEC_HOME=home), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def wait_up(process: subprocess.Popen, timeout_s: float = 300) -> list[str]:
    lines, deadline = [], time.monotonic() + timeout_s
    for line in process.stdout:
        lines.append(line.rstrip())
        if "OpenAI-compatible API on" in line and line.startswith("specdec up"):
            return lines
        if time.monotonic() > deadline:
            break
    raise SystemExit("the stack did not come up:\n" + "\n".join(lines[-30:]))


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()


def verifier_start(lines: list[str]) -> dict:
    """From the verifier's first log line to its last before SERVING (the KV pool's)."""
    stamps = [(datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f"), line) for line in lines
              if (m := STAMP.match(line))]
    first = stamps[0][0]
    ready = next(t for t, line in stamps if "KV cache pool" in line or "forward ms by rows" in line)
    decision = next((line.split(": ", 1)[-1] for _, line in stamps
                     if "start profile" in line or "decode step now" in line or "cost curves from" in line),
                    "timed (no profile)")
    bound = next((line.split("coordinator: ", 1)[-1] for line in lines if "a perfect free draft" in line), "")
    ceiling = re.search(r"at most ([\d.]+)x", bound)
    curve = next((line.split("forward ms by rows ", 1)[-1] for _, line in stamps if "forward ms by rows" in line), "")
    return {"to_serving_s": round((ready - first).total_seconds(), 2), "decision": decision[:200],
            "bound_x": float(ceiling.group(1)) if ceiling else None, "bound": bound[:200], "curve": curve[:120]}


def load(url: str, clients: int, stopping: threading.Event) -> None:
    body = {"prompt": "a tale", "max_tokens": 512, "ignore_eos": True, "temperature": 0}

    def client() -> None:
        while not stopping.is_set():
            try:
                httpx.post(url + "/v1/completions", json=body, timeout=60)
            except httpx.HTTPError:
                time.sleep(0.1)
    for _ in range(clients):
        threading.Thread(target=client, daemon=True).start()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default="tiny")
    parser.add_argument("--clients", type=int, default=4, help="HTTP clients of the loading stack")
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory() as measured_home, tempfile.TemporaryDirectory() as loader_home:
        for name in ("clean", "busy", "quiet"):
            stopping = threading.Event()
            loader = None
            if name == "busy":
                loader = up(args.pair, loader_home, 50151, 8101)
                wait_up(loader)
                load("http://127.0.0.1:8101", args.clients, stopping)
                time.sleep(3)   # the load under way
            stack = up(args.pair, measured_home, 50161, 8111)
            try:
                rows[name] = verifier_start(wait_up(stack))
            finally:
                stop(stack)
                stopping.set()
                if loader is not None:
                    stop(loader)
            print(f"| {name} | {rows[name]['to_serving_s']} | {rows[name]['bound_x']} | {rows[name]['decision']} |",
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
