"""Start the three services as child processes, as `specdec up` and `specdec bench`
both need: pull the models, start drafter and verifier at once, wait for their
SERVING lines, then start the coordinator against them; then supervise them.

Sidecar mode: the drafter and the verifier serve Unix domain sockets in a
private directory (0700), so only this user reaches them and a round's two RPCs
skip TCP; `model_transport="tcp"` serves them on loopback ports instead.
A child that exits is restarted with backoff at the same address (`Supervisor`),
like a process manager: the coordinator goes on target-only while the drafter is
away, and answers UNAVAILABLE while the verifier is. With `standby`, each child
has a spare process waiting with its imports done (specdec_tools/standby.py),
which a restart takes over: a restart then costs the service's load and warm-up,
not Python's imports."""
from __future__ import annotations

import importlib.util
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from specdec.rpc.serving import PARENT_PID_ENV
from specdec.weights import registry
from specdec.weights.pairs import Pair


# glibc's malloc for the services (the image's environment sets the same). Few arenas: glibc
# otherwise keeps one per busy thread (gRPC workers), and freed KV caches linger in them as
# RSS. Blocks up to 32 MiB (glibc's largest mmap threshold) come from the heap, which gives
# memory back only past 1 GiB free at its top: a forward's large temporaries (18 MB for a
# 256-token prefill chunk's gate/up on the 1.5B), mmapped anew and faulted in page by page
# on every call, cost a 362-token prompt 170-210k page faults and up to 2.3 s of system time
# in a VM (its first prefill after a start 5.2 s against 3.0 with these; docs/runs/faults.md).
# The price: KV pages of ended sessions stay in RSS for the next sessions, up to that 1 GiB.
MALLOC_ENV = {"MALLOC_ARENA_MAX": "2", "MALLOC_MMAP_THRESHOLD_": str(32 << 20),
              "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}


@dataclass
class Child:
    name: str
    module: str
    args: list[str]
    process: subprocess.Popen | None = None
    address: str = ""
    http_port: int | None = None    # the coordinator's OpenAI-compatible front, from its SERVING line
    serving: threading.Event = field(default_factory=threading.Event)
    started_at: float = 0.0
    restarts: int = 0
    env: dict[str, str] = field(default_factory=dict)  # on top of this process's environment
    standby: subprocess.Popen | None = None  # its imports done, for the next (re)start (keep_standby)
    keep_standby: bool = False

    def _popen(self, argv: list[str], stdin=None) -> subprocess.Popen:
        env = {**MALLOC_ENV, **os.environ, **self.env,
               PARENT_PID_ENV: str(os.getpid())}   # it stops when this process is gone (serving.run_until_signal)
        return subprocess.Popen([sys.executable, "-u", *argv], stdin=stdin, stdout=subprocess.PIPE, text=True, env=env)

    def spawn_standby(self) -> None:
        """A spare process for the next (re)start, importing while this one serves."""
        self.keep_standby = True
        if self.standby is None or self.standby.poll() is not None:
            self.standby = self._popen(["-m", "specdec_tools.standby", self.module], stdin=subprocess.PIPE)

    def drop_standby(self) -> None:
        standby, self.standby, self.keep_standby = self.standby, None, False
        if standby is not None and standby.poll() is None:
            standby.kill()   # it serves nothing and holds nothing: no need to wait out its imports
            standby.wait()

    def start(self) -> "Child":
        """(Re)start `python -m module`, in its standby where there is one; `wait_serving`
        waits for its 'NAME SERVING on ADDRESS' line."""
        self.serving = threading.Event()
        standby, self.standby = self.standby, None
        if standby is not None and standby.poll() is None:
            standby.stdin.write(json.dumps(self.args) + "\n")
            standby.stdin.close()
            process = standby
        else:
            process = self._popen(["-m", self.module, *self.args])
        self.process = process
        self.started_at = time.monotonic()
        serving = self.serving

        def read() -> None:
            for line in process.stdout:  # keep draining, so a chatty child never blocks
                if not serving.is_set() and " SERVING on " in line:
                    words = line.split(" SERVING on ", 1)[1].split()
                    self.address = words[0]
                    self.http_port = next((int(w[5:]) for w in words[1:] if w.startswith("http=")), None)
                    serving.set()
                    if self.keep_standby:   # serving again after a restart: the next spare
                        self.spawn_standby()

        threading.Thread(target=read, daemon=True).start()
        return self

    def pin_address(self) -> None:
        """A restart must come back where its clients look: the port it got, not port 0."""
        if "--port" in self.args and not self.address.startswith("unix:"):
            self.args[self.args.index("--port") + 1] = self.address.rsplit(":", 1)[1]
        if "--http-port" in self.args and self.http_port:
            self.args[self.args.index("--http-port") + 1] = str(self.http_port)


BACKEND_TOKEN_ENV = "SPECDEC_BACKEND_TOKEN"  # the stack's own token for its model services over TCP


STANDBY_DELAY_S = 5.0  # after the stack serves, before its standbys start importing


class LaunchError(RuntimeError):
    pass


def spawn(name: str, module: str, args: list[str], env: dict[str, str] | None = None) -> Child:
    return Child(name, module, list(args), env=dict(env or {})).start()


def wait_serving(child: Child, ready_timeout_s: float) -> Child:
    deadline = time.monotonic() + ready_timeout_s
    while not child.serving.wait(0.1):
        if child.process.poll() is not None:
            raise LaunchError(f"{child.name} exited with code {child.process.returncode} before serving")
        if time.monotonic() > deadline:
            child.process.terminate()
            raise LaunchError(f"{child.name} not serving after {ready_timeout_s:.0f} s")
    child.pin_address()
    return child


def stop(children: list[Child], grace_s: float = 30.0) -> None:
    """SIGTERM the coordinator first and let it drain its requests, then the
    model services it was using (they would otherwise fail its in-flight rounds)."""
    for child in children:
        child.drop_standby()
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


@dataclass(frozen=True)
class Backoff:
    # A child that ran healthy is restarted at once (every second away from serving is
    # requests without it); one that exits again waits first_s, then twice as long ...
    first_s: float = 0.5
    max_s: float = 30.0      # ... up to this
    healthy_s: float = 60.0  # a child that ran this long starts over

    def delay(self, restarts: int) -> float:
        return 0.0 if restarts == 0 else min(self.max_s, self.first_s * 2 ** (restarts - 1))


class Supervisor:
    """Restarts children that exit, with exponential backoff, at their addresses."""

    def __init__(self, children: list[Child], say: Callable[[str], None], backoff: Backoff = Backoff()):
        self.children = children
        self.say = say
        self.backoff = backoff
        self._due: dict[str, float] = {}  # child name -> when to restart it
        self._back: set[str] = set()      # restarted, not yet serving again

    def poll(self) -> None:
        """One look at every child: note exits, restart what is due, report comebacks."""
        now = time.monotonic()
        for child in self.children:
            code = child.process.poll()
            if code is None:
                if child.name in self._back and child.serving.is_set():
                    self._back.discard(child.name)
                    self.say(f"{child.name} is back on {child.address} (pid {child.process.pid})")
                continue
            if child.name not in self._due:
                if now - child.started_at >= self.backoff.healthy_s:
                    child.restarts = 0
                delay = self.backoff.delay(child.restarts)
                self._due[child.name] = now + delay
                consequence = {"drafter": "requests go on target-only meanwhile",
                               "verifier": "requests get UNAVAILABLE meanwhile"}.get(child.name, "")
                self.say(f"{child.name} (pid {child.process.pid}) exited with code {code}; restarting in "
                         f"{delay:.1f} s{'; ' + consequence if consequence else ''}")
            elif now >= self._due[child.name]:
                del self._due[child.name]
                child.restarts += 1
                child.start()
                self._back.add(child.name)
                self.say(f"{child.name} restarted (pid {child.process.pid}, restart {child.restarts})")


@dataclass
class StackOptions:
    pair: Pair
    draft_model: str
    target_model: str
    draft_quantize: str
    head_vocab: int
    target_quantize: str = "none"
    forward: str = "lean"  # the model services' forward: lean, or hf (transformers')
    device: str = "cpu"
    host: str = "127.0.0.1"
    port: int = 50051
    gamma: str = "auto"
    gamma_max: int = 0  # 0: from the verifier's cost curve
    trace_file: str | None = None
    ready_timeout_s: float = 900.0
    threads: int = 0
    model_transport: str = "uds"  # drafter and verifier on Unix sockets in a private directory, or "tcp" (loopback)
    standby: bool = False  # a spare process per service for restarts (specdec up), once the stack serves
    coordinator_args: tuple[str, ...] = ()  # passed on as they are (auth, TLS, limits)
    drafter_args: tuple[str, ...] = ()      # ... and to each model service (its limits, threads, KV budget)
    verifier_args: tuple[str, ...] = ()

    @property
    def draft_dtype(self) -> str:
        """The dtype the drafter runs in (its quantization's, else the pair's)."""
        return _dtype(self.pair.draft_dtype, self.draft_quantize, self.device)

    @property
    def target_dtype(self) -> str:
        return _dtype(self.pair.target_dtype, self.target_quantize, self.device)

    @classmethod
    def for_pair(cls, pair: Pair, **overrides) -> "StackOptions":
        """The pair's models and settings; overrides that are None keep the pair's."""
        given = {k: v for k, v in overrides.items() if v is not None}
        if given.get("device", "cpu") != "cpu" and "target_quantize" not in given and pair.target_quantize == "int4":
            given["target_quantize"] = "none"  # int4 runs torch's CPU kernel; a GPU serves the pair's dtype
        if "draft_quantize" not in given and pair.draft_quantize == "q4_0" and (
                given.get("device", "cpu") != "cpu" or importlib.util.find_spec("llama_cpp") is None):
            # A Q4_0 draft is fast on llama.cpp's CPU kernels only (the llama-cpp extra): INT8 elsewhere.
            given["draft_quantize"] = "int8"
        return cls(**{"pair": pair, "draft_model": pair.draft, "target_model": pair.target,
                      "draft_quantize": pair.draft_quantize, "head_vocab": pair.draft_head_vocab,
                      "target_quantize": pair.target_quantize, **given})


def _dtype(pair_dtype: str, quantize: str, device: str) -> str:
    # int4 runs its kernel on bf16 activations: the rest of the model runs bf16 too. So does
    # INT8 off the CPU (weight-only there, in the model's dtype: quant.int8_device).
    return "bf16" if quantize == "int4" or (quantize == "int8" and device != "cpu") else pair_dtype


def pull_models(names: list[str], say=print) -> None:
    """Pull registry models once, here, rather than in two services at once."""
    for name in dict.fromkeys(names):
        if name in registry.MODELS and not registry.is_pulled(registry.lookup(name)):
            registry.pull(name, on_step=say)


class SocketDir:
    """A private (0700) directory for the model services' sockets, removed at the end."""

    def __init__(self):
        self.path = tempfile.mkdtemp(prefix="specdec-")  # mkdtemp makes it 0700

    def socket(self, name: str) -> str:
        return os.path.join(self.path, f"{name}.sock")

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


class Stack:
    """The three services of one `StackOptions`, their socket directory, and their end."""

    def __init__(self, options: StackOptions):
        self.options = options
        self._standby_timer: threading.Timer | None = None
        self._standby_lock = threading.Lock()
        self._stopping = False
        self.children: list[Child] = []  # in start order, so a failed launch stops what did start
        self.sockets = SocketDir() if options.model_transport == "uds" else None
        # Over TCP, even on loopback, any local user could call the model services:
        # they require a token made for this stack, which only its processes hold.
        self.env = {} if self.sockets else {BACKEND_TOKEN_ENV: secrets.token_urlsafe(32)}

    def launch(self) -> Child:
        """Start all three and return the serving coordinator."""
        options = self.options
        tracing = ["--trace-file", options.trace_file] if options.trace_file else []
        common = ["--device", options.device, "--threads", str(options.threads), "--forward", options.forward,
                  *tracing]
        # The drafter first, then the verifier: each times its forwards at warm-up
        # (the cost curve in Info), which the other's loading would disturb.
        self.children.append(spawn("drafter", "drafter", [
            "--model", options.draft_model, "--dtype", options.draft_dtype,
            "--quantize", options.draft_quantize, "--head-vocab", str(options.head_vocab), *self._listen("drafter"),
            *common, *options.drafter_args], self.env))
        drafter = wait_serving(self.children[-1], options.ready_timeout_s)
        self.children.append(spawn("verifier", "verifier", [
            "--model", options.target_model, "--dtype", options.target_dtype,
            "--quantize", options.target_quantize, *self._listen("verifier"),
            *common, *options.verifier_args], self.env))
        verifier = wait_serving(self.children[-1], options.ready_timeout_s)
        self.children.append(spawn("coordinator", "coordinator", [
            "--drafter", drafter.address, "--verifier", verifier.address, "--host", options.host,
            "--port", str(options.port), "--gamma", str(options.gamma), "--gamma-max", str(options.gamma_max),
            *tracing, *self._backend_auth(), *options.coordinator_args], self.env))
        coordinator = wait_serving(self.children[-1], options.ready_timeout_s)
        if options.standby:
            # Not before the stack serves (their imports would disturb the services' timings at
            # warm-up), nor at once: a stack's first requests do not share the cores with them
            # where their imports cannot yield them (nice 19 where it can be undone: standby.py).
            self._standby_timer = threading.Timer(STANDBY_DELAY_S, self._spawn_standbys)
            self._standby_timer.daemon = True
            self._standby_timer.start()
        return coordinator

    def _spawn_standbys(self) -> None:
        with self._standby_lock:
            if not self._stopping:
                for child in self.children:
                    child.spawn_standby()

    def _listen(self, name: str) -> list[str]:
        if self.sockets is not None:
            return ["--uds", self.sockets.socket(name)]
        return ["--host", "127.0.0.1", "--port", "0", "--auth-token-env", BACKEND_TOKEN_ENV]

    def _backend_auth(self) -> list[str]:
        return ["--backend-auth-token-env", BACKEND_TOKEN_ENV] if self.env else []

    def child(self, name: str) -> Child:
        return next(c for c in self.children if c.name == name)

    def info(self, name: str):
        """The model service `name`'s Info (a specdec.v1 ModelInfo)."""
        from specdec.rpc.serving import channel
        from specdec.v1 import common_pb2, drafter_pb2_grpc, verifier_pb2_grpc
        stub_cls = drafter_pb2_grpc.DrafterStub if name == "drafter" else verifier_pb2_grpc.VerifierStub
        with channel(self.child(name).address, None, self.env.get(BACKEND_TOKEN_ENV)) as ch:
            return stub_cls(ch).Info(common_pb2.InfoRequest(), timeout=10)

    def settle(self, timeout_s: float = 300.0, say: Callable[[str], None] = print) -> None:
        """Wait until the model services have made the kernels they make after SERVING
        (Info.kernels_pending): a benchmark measures the stack as it will serve, not
        while a verifier still makes its batches' kernels between forwards."""
        deadline, said = time.monotonic() + timeout_s, False
        while True:
            pending = {name: self.info(name).kernels_pending for name in ("drafter", "verifier")}
            if not any(pending.values()):
                return
            if time.monotonic() > deadline:
                say(f"measuring with kernels still pending after {timeout_s:.0f} s ({pending})")
                return
            if not said:
                say("waiting for the model services' kernels for batches of several sessions ("
                    + ", ".join(f"{name}: {n} layers" for name, n in pending.items() if n) + ")")
                said = True
            time.sleep(0.5)

    def stop(self, grace_s: float = 30.0) -> None:
        with self._standby_lock:
            self._stopping = True
            if self._standby_timer is not None:
                self._standby_timer.cancel()
        stop(self.children, grace_s)
        if self.sockets is not None:
            self.sockets.remove()
