"""A service process kept waiting with its imports done, for `specdec up`'s next
restart of that service: `python -m specdec_tools.standby MODULE` imports
`MODULE.__main__` (torch and transformers, for a model service: about 3 s of the
tiny pair's restart), then reads one line, the service's arguments as a JSON
list, and runs `MODULE.__main__.main` with them. A restart then costs the
service's load and warm-up alone. An empty line (the launcher went away, or
stopped the stack) ends it without serving anything.

The imports run on a thread of their own at the lowest CPU priority (nice 19), where
this process may raise it back: some seconds of CPU for each of the stack's three
standbys, which on a 2-core machine otherwise take the cores from the services and
made the requests of the stack's first half minute 2-3x slower. The restart's line,
arriving while they still run, raises them back at once, so a restart under load does
not wait on imports starved by the load. Where the priority could not be raised again
(no CAP_SYS_NICE and an RLIMIT_NICE of 0, as in a default container), the imports keep
the process's priority. Linux only: elsewhere a thread's priority is the process's."""
from __future__ import annotations

import importlib
import json
import os
import sys
import threading

IDLE_NICE = 19


def reversible_nice(nice: int = IDLE_NICE) -> bool:
    """Whether a thread of this process can go to `nice` and come back to its priority:
    tried on a thread of its own, which then ends (its priority with it)."""
    if not sys.platform.startswith("linux"):
        return False
    undone = []

    def probe() -> None:
        base = os.getpriority(os.PRIO_PROCESS, 0)   # on Linux, the calling thread's
        try:
            os.setpriority(os.PRIO_PROCESS, 0, max(base, nice))
            os.setpriority(os.PRIO_PROCESS, 0, base)
            undone.append(True)
        except OSError:
            pass
    thread = threading.Thread(target=probe, name="nice-probe")
    thread.start()
    thread.join()
    return bool(undone)


class Imports:
    """`MODULE.__main__` imported on a thread at `nice` (where it can be undone, else at the
    process's priority), until `hurry` raises it back."""

    def __init__(self, module: str, nice: int = IDLE_NICE):
        self.module, self.nice = module, nice
        self.base = os.getpriority(os.PRIO_PROCESS, 0)
        self.lowered = nice > self.base and reversible_nice(nice)
        self.done = threading.Event()
        self._tid: int | None = None
        self._lock = threading.Lock()
        self._hurried = False
        self.thread = threading.Thread(target=self._run, name="standby-imports", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            with self._lock:
                self._tid = threading.get_native_id()
                if self.lowered and not self._hurried:
                    os.setpriority(os.PRIO_PROCESS, 0, self.nice)
            importlib.import_module(f"{self.module}.__main__")
        except BaseException:   # the main thread imports again, and raises it there
            pass
        finally:
            self.done.set()

    def hurry(self) -> None:
        """The restart has come: what is left of the imports runs at the process's priority."""
        with self._lock:
            self._hurried = True
            if self.lowered and self._tid is not None and not self.done.is_set():
                try:
                    os.setpriority(os.PRIO_PROCESS, self._tid, self.base)
                except OSError:   # the thread ended meanwhile: nothing left to hurry
                    pass

    def entry(self):
        """The module, imported: the rest of its imports here, if any failed on the thread; every
        thread they started (a kernel library's OpenMP workers, which the service's forwards
        run on) back at the process's priority."""
        self.thread.join()
        if self.lowered:
            for task in os.listdir("/proc/self/task"):
                try:
                    if os.getpriority(os.PRIO_PROCESS, int(task)) == self.nice:
                        os.setpriority(os.PRIO_PROCESS, int(task), self.base)
                except OSError:   # ended meanwhile
                    pass
        return importlib.import_module(f"{self.module}.__main__")


def main() -> int:
    module = sys.argv[1]
    imports = Imports(module)
    line = sys.stdin.readline()
    if not line.strip():
        return 0
    imports.hurry()
    entry = imports.entry()
    args = json.loads(line)
    sys.argv = [f"python -m {module}", *args]
    entry.main(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
