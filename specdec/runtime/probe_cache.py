"""Child-process probes that passed on this machine, remembered across starts.

A native library built for another CPU can end the process that calls it (SIGILL,
an assertion), so its first calls run in a child process (`ggml.selftest`,
`ggml.repack_usable`): each child imports torch again, a second or several of
every start (5.8 s of the 1.5B verifier's on a 2-core EPYC). Their outcome
depends only on the CPU and the library's build, so a probe that passed is kept
here, under a key of those, and is not run again while the key holds. A probe
that failed is not kept: it runs again at the next start, where a passing run
(a timeout on a loaded machine, a library since rebuilt) can still admit it.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
import sys
import tempfile
import threading
from importlib import metadata

from specdec.weights import registry

log = logging.getLogger(__name__)
_lock = threading.Lock()


def _machine() -> str:
    """The CPU (its model and flags), the Python and the probed library's build."""
    try:
        cpuinfo = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = ""
    lines = {line.split(":", 1)[0].strip(): line.split(":", 1)[1].strip()
             for line in cpuinfo.splitlines() if ":" in line}
    try:
        library = metadata.version("llama_cpp_python")
    except metadata.PackageNotFoundError:
        library = ""
    fields = [lines.get("model name", ""), lines.get("flags", ""), sys.executable, library]
    return hashlib.sha256("|".join(fields).encode()).hexdigest()[:24]


def _path() -> pathlib.Path:
    return registry.home() / "starts" / f"probes-{_machine()}.json"


def _read(path: pathlib.Path) -> set[str]:
    try:
        return set(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return set()


def passed(name: str) -> bool:
    """Whether the probe `name` passed on this machine before."""
    return name in _read(_path())


def remember(name: str) -> None:
    """Keep that the probe `name` passed (atomically; a failure to write costs a probe)."""
    path = _path()
    with _lock:
        names = _read(path) | {name}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
                json.dump(sorted(names), f)
            os.replace(f.name, path)
        except OSError as error:
            log.debug("could not keep probe %s in %s: %s", name, path, error)
