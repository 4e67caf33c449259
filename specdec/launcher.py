"""Start the three services as child processes on loopback, as `specdec up` and
`specdec bench` both need: pull the models, start drafter and verifier at once,
wait for their SERVING lines, then start the coordinator against them."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from specdec import registry
from specdec.models import Pair


@dataclass
class Child:
    name: str
    process: subprocess.Popen
    address: str = ""
    serving: threading.Event = field(default_factory=threading.Event)


class LaunchError(RuntimeError):
    pass


def spawn(name: str, module: str, args: list[str]) -> Child:
    """Start `python -m module`; `wait_serving` waits for its 'NAME SERVING on HOST:PORT' line."""
    # Few malloc arenas: glibc otherwise keeps one per busy thread (gRPC workers),
    # and freed KV caches linger in them as RSS.
    env = {"MALLOC_ARENA_MAX": "2", **os.environ}
    process = subprocess.Popen([sys.executable, "-u", "-m", module, *args], stdout=subprocess.PIPE, text=True,
                               env=env)
    child = Child(name, process)

    def read() -> None:
        for line in process.stdout:  # keep draining, so a chatty child never blocks
            if not child.serving.is_set() and " SERVING on " in line:
                child.address = line.split(" SERVING on ", 1)[1].split()[0]
                child.serving.set()

    threading.Thread(target=read, daemon=True).start()
    return child


def wait_serving(child: Child, ready_timeout_s: float) -> Child:
    deadline = time.monotonic() + ready_timeout_s
    while not child.serving.wait(0.1):
        if child.process.poll() is not None:
            raise LaunchError(f"{child.name} exited with code {child.process.returncode} before serving")
        if time.monotonic() > deadline:
            child.process.terminate()
            raise LaunchError(f"{child.name} not serving after {ready_timeout_s:.0f} s")
    return child


def stop(children: list[Child], grace_s: float = 30.0) -> None:
    """SIGTERM the coordinator first and let it drain its requests, then the
    model services it was using (they would otherwise fail its in-flight rounds)."""
    front = [c for c in children if c.name == "coordinator"]
    for group in (front, [c for c in children if c not in front]):
        for child in group:
            if child.process.poll() is None:
                child.process.send_signal(signal.SIGTERM)
        for child in group:
            try:
                child.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                child.process.kill()


@dataclass
class StackOptions:
    pair: Pair
    draft_model: str
    target_model: str
    draft_quantize: str
    head_vocab: int
    device: str = "cpu"
    host: str = "127.0.0.1"
    port: int = 50051
    gamma: str = "auto"
    gamma_max: int = 8
    trace_file: str | None = None
    ready_timeout_s: float = 900.0
    threads: int = 0
    coordinator_args: tuple[str, ...] = ()  # passed on as they are (auth, TLS, limits)

    @classmethod
    def for_pair(cls, pair: Pair, **overrides) -> "StackOptions":
        """The pair's models and settings; overrides that are None keep the pair's."""
        given = {k: v for k, v in overrides.items() if v is not None}
        return cls(**{"pair": pair, "draft_model": pair.draft, "target_model": pair.target,
                      "draft_quantize": pair.draft_quantize, "head_vocab": pair.draft_head_vocab, **given})


def pull_models(names: list[str], say=print) -> None:
    """Pull registry models once, here, rather than in two services at once."""
    for name in dict.fromkeys(names):
        if name in registry.MODELS and not registry.is_pulled(registry.lookup(name)):
            registry.pull(name, on_step=say)


def launch(options: StackOptions, children: list[Child]) -> Child:
    """Start all three; appends to `children` as they start (so the caller can
    stop them on any failure) and returns the serving coordinator."""
    tracing = ["--trace-file", options.trace_file] if options.trace_file else []
    common = ["--device", options.device, "--host", "127.0.0.1", "--port", "0", "--threads", str(options.threads),
              *tracing]
    # Both models load at once; the coordinator checks them once both serve.
    children.append(spawn("drafter", "drafter", [
        "--model", options.draft_model, "--dtype", options.pair.draft_dtype, "--quantize", options.draft_quantize,
        "--head-vocab", str(options.head_vocab), *common]))
    children.append(spawn("verifier", "verifier", [
        "--model", options.target_model, "--dtype", options.pair.target_dtype, *common]))
    drafter, verifier = (wait_serving(child, options.ready_timeout_s) for child in children[-2:])
    children.append(spawn("coordinator", "coordinator", [
        "--drafter", drafter.address, "--verifier", verifier.address, "--host", options.host,
        "--port", str(options.port), "--gamma", str(options.gamma), "--gamma-max", str(options.gamma_max), *tracing,
        *options.coordinator_args]))
    return wait_serving(children[-1], options.ready_timeout_s)
