"""What a model service measures at start, kept per machine and model and reused.

Before it serves, a model service times its kernels (`kernel_choices.pick`'s choice for
every layer shape and row bucket), its cost curve (a forward's ms by rows, and a
prefill's per token) and what batches of several sessions cost. That is most of a
start: about 50 of the 65 s the default pair's 1.5B verifier took on a 2-core
EPYC. None of it changes until the machine, the libraries, the model or the
service's settings do, so the first start saves it here, under a key made of all
of those (`profile_key`), and a later start with the same key loads it instead of
timing again.

A loaded profile is checked before it is trusted: a decode step is timed now (the
least of up to CHECK_TRIES tries) and must be within CHECK_TOLERANCE of the saved
curve's first point (a VM resized under the same CPU model, another tenant on the
cores). Where it is not:
- while other processes keep the cores busy (on a CPU device; `MachineLoad`: their CPU
  time over the check, QUIET_SHARE of the cores or more), the step is slow because of them, not
  because the machine changed: the saved profile serves, and nothing is timed;
- on a quiet machine the service times everything again, as on a first start.
A start's own timings are saved only where they agree with themselves (a decode
step timed again at the end within CHECK_TOLERANCE of the curve's) and, on a CPU,
the machine was quiet while they were taken: a verifier restarted under another stack's load
once timed its one-row step at 8.1 ms against 2.4 and saved that, the next quiet
start disagreed and timed everything again (10-12 s to SERVING instead of 0.5), and
every coordinator started meanwhile priced speculation from it. A saved profile
that a quiet start replaces is set aside (`<name>.aside.json`), not lost. Once
serving, the live curve refreshes the cost curve from real forwards, as after any
start.
The files are JSON under $SPECDEC_HOME/starts/, written atomically by the services.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
import platform
import tempfile
import time
from dataclasses import dataclass, field
from importlib import metadata

import psutil
import torch

from specdec.runtime import ggml, kernels
from specdec.runtime.cost_curve import CostCurve
from specdec.weights import registry

log = logging.getLogger(__name__)
FORMAT = 2             # raised whenever what a profile holds, or how it is read, changes
CHECK_TOLERANCE = 0.3  # a decode step timed at start within this of the saved one: the profile holds ...
CHECK_FLOOR_MS = 1.0   # ... or within this many ms (a tiny model's 0.3 ms step is mostly noise)
# Decode steps timed (3 each) before a profile is called stale: a restarted 1.5B verifier's
# first took 44.4 ms against 30.1 saved, and timing everything again made its restart 86.8 s.
CHECK_TRIES = 3
# Other processes' CPU time while a start times, as a share of the machine's cores, from
# which its timings are not trusted: not saved, and not taken over a saved profile.
QUIET_SHARE = 0.2


class MachineLoad:
    """What other processes ran on this machine from this object's making until
    `others_share`: the machine's busy CPU time (steal included: in a VM, the host's
    other guests) less this process's own (every thread's), as a share of all cores
    over the wall time."""

    def __init__(self) -> None:
        self.started, self.busy, self.own = time.monotonic(), _busy_s(), _own_s()

    def others_share(self) -> float:
        wall = time.monotonic() - self.started
        if wall <= 0.0:
            return 0.0
        others = (_busy_s() - self.busy) - (_own_s() - self.own)
        return max(others, 0.0) / (wall * (psutil.cpu_count() or 1))


def _busy_s() -> float:
    t = psutil.cpu_times()
    return sum(getattr(t, name, 0.0) for name in ("user", "nice", "system", "irq", "softirq", "steal"))


def _own_s() -> float:
    t = psutil.Process().cpu_times()
    return t.user + t.system


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return ""


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _backend_packages() -> dict[str, str]:
    """Each registered kernel backend's module and the packages that install it, with their
    versions ("" where none does): a backend installed or upgraded since a profile was kept
    is timed at the next start, not left out behind the profile kept without it."""
    providers = metadata.packages_distributions()
    return {backend.module: " ".join(sorted(f"{name}=={_version(name)}" for name in providers.get(backend.module, ())))
            for backend in kernels.BACKENDS}


def isa() -> dict[str, str]:
    """The instruction sets in force, which a CPU's flags do not say: torch's kernels run at
    the capability ATEN_CPU_CAPABILITY holds them to (AVX2 on an AVX-512 machine, to measure
    an AVX2-only one), and ggml's at what its build was compiled for."""
    return {"torch": torch.backends.cpu.get_cpu_capability(), "ggml": ggml.isa()}


def profile_key(model_identity: str, device: str, settings: dict[str, object]) -> dict[str, object]:
    """Everything a start's timings depend on: the machine (CPU model and features, the
    instruction sets in force, the threads torch runs on), the libraries whose kernels
    were timed, the model (its converted form's identity) and the service's settings
    that change what is timed."""
    return {
        "format": FORMAT, "cpu": _cpu_model(), "isa": isa(),
        "cpu_flags": hashlib.sha256(" ".join(sorted(kernels.cpu_flags())).encode()).hexdigest()[:16],
        "threads": torch.get_num_threads(), "device": device,
        "torch": torch.__version__, "transformers": _version("transformers"),
        "backends": _backend_packages(), "model": model_identity, **settings,
    }


def path_for(key: dict[str, object], root: pathlib.Path | None = None) -> pathlib.Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return (root or registry.home() / "starts") / f"{digest}.json"


@dataclass
class StartProfile:
    curve: CostCurve
    gathered: dict[int, float] = field(default_factory=dict)   # {sessions' rows: ms}, model_service's
    choices: dict[tuple, str] = field(default_factory=dict)     # kernel_choices.pick's, as a KernelState holds them

    def to_json(self, key: dict[str, object]) -> str:
        return json.dumps({
            "key": key, "saved": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "forward_ms": self.curve.forward_ms, "prefill_ms_per_token": self.curve.prefill_ms_per_token,
            "gathered": {str(rows): ms for rows, ms in self.gathered.items()},
            "choices": [[list(k), name] for k, name in self.choices.items()
                        if all(isinstance(part, (str, int)) for part in k)],
        }, indent=1)

    @classmethod
    def from_json(cls, text: str, key: dict[str, object]) -> "StartProfile":
        data = json.loads(text)
        if data.get("key") != key:
            raise ValueError("saved under another key")
        forward = [float(ms) for ms in data["forward_ms"]]
        if not forward or any(not ms > 0 for ms in forward):
            raise ValueError("no cost curve")
        return cls(CostCurve(forward, float(data["prefill_ms_per_token"])),
                   {int(rows): float(ms) for rows, ms in data["gathered"].items()},
                   {tuple(k): str(name) for k, name in data["choices"]})


def load(key: dict[str, object], root: pathlib.Path | None = None) -> StartProfile | None:
    """The profile saved under `key`, or None (none yet, or unreadable: then timed again)."""
    path = path_for(key, root)
    try:
        return StartProfile.from_json(path.read_text(), key)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as error:
        log.warning("the start profile %s cannot be used (%s); timing again", path, error)
        return None


def save(profile: StartProfile, key: dict[str, object], root: pathlib.Path | None = None) -> pathlib.Path | None:
    """Write it atomically (a start that dies mid-write leaves the old file or none)."""
    path = path_for(key, root)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=path.stem, suffix=".tmp",
                                         delete=False) as f:
            f.write(profile.to_json(key))
        os.replace(f.name, path)
        return path
    except OSError as error:
        log.warning("could not save the start profile to %s (%s); the next start times again", path, error)
        return None


def holds(curve: CostCurve, decode_ms: float) -> bool:
    """Whether a decode step timed now agrees with the curve's one-row point (CHECK_TOLERANCE)."""
    saved = curve.forward_ms[0]
    return abs(decode_ms - saved) <= max(CHECK_TOLERANCE * saved, CHECK_FLOOR_MS)


def set_aside(key: dict[str, object], root: pathlib.Path | None = None) -> None:
    """Move the profile saved under `key` out of the way of the one about to replace it."""
    path = path_for(key, root)
    try:
        os.replace(path, path.with_suffix(".aside.json"))
    except OSError:
        pass
