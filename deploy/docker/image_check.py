#!/usr/bin/env python
"""What a built image holds, and the image run for real; one table.
deploy/docker/test-image.sh builds the image and runs this.

  1. the image: its size (and the build's time, when given);
  2. the user: the non-root ids the chart's securityContext runs as;
  3. the chart's commands: every container the chart renders (init containers
     included, every tested variation) names a command found in the image, and
     that command answers --help there;
  4. nothing left of the build: no compiler, no pip or apt cache, no sources;
  5. `specdec up --pair tiny` inside the image, a Generate sent from outside
     (loopback is shared with the container): greedy speculative output equal to
     target-only on 3 prompts, then SIGTERM and a clean exit.

The container is run with `buildah run --isolation chroot` (no OCI runtime
needed); the host side needs the project installed with its test extra (the
chart is rendered by helm-python-sdk). Exit status 1 if any check failed.

  python deploy/docker/image_check.py --image localhost/specdec:cpu
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import shlex
import signal
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from specdec_tools.checks import GREEDY_PROMPTS, greedy_runs, run_checks  # noqa: E402

UP_LINE = "specdec up: coordinator on "
COMPILERS = ("gcc", "cc", "c++", "g++", "clang", "make", "ld")
BUILD_LEFTOVERS = ("/src", "/tmp/specdec-src", "/root/.cache", "/home/specdec/.cache", "/tmp/pip-*", "/var/cache/apt/archives/*.deb",
                   "/var/lib/apt/lists/*_Packages")


class Container:
    """A working container of IMAGE (`buildah from`), removed at the end."""

    def __init__(self, image: str):
        self.name = subprocess.run(["buildah", "from", "--pull-never", image], check=True, capture_output=True,
                                   text=True).stdout.strip().splitlines()[-1]

    def command(self, script: str, user: str | None = None, mounts: tuple[str, ...] = ()) -> list[str]:
        args = ["buildah", "run", "--isolation", "chroot"]
        for mount in mounts:
            args += ["--volume", mount]
        if user:
            args += ["--user", user]
        return [*args, self.name, "--", "sh", "-c", script]

    def sh(self, script: str, user: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(script, user), capture_output=True, text=True, timeout=timeout)

    def kill_all(self) -> None:
        """SIGKILL whatever still runs in the container: every process whose root is its file system."""
        root = subprocess.run(["buildah", "mount", self.name], capture_output=True, text=True).stdout.strip()
        for proc in pathlib.Path("/proc").iterdir():
            try:
                if proc.name.isdigit() and root and os.readlink(proc / "root") == root:
                    os.kill(int(proc.name), signal.SIGKILL)
            except OSError:
                pass  # gone already, or not ours to read

    def remove(self) -> None:
        self.kill_all()
        subprocess.run(["buildah", "rm", self.name], capture_output=True)


def chart_pods() -> list[dict]:
    """The pod specs of every Deployment the chart renders, over the tested variations."""
    from tests.test_helm import VARIATIONS, render
    pods = []
    for values in VARIATIONS.values():
        pods += [d["spec"]["template"]["spec"] for d in render(values) if d["kind"] == "Deployment"]
    return pods


def inspect(image: str) -> dict:
    out = subprocess.run(["podman", "image", "inspect", image], check=True, capture_output=True, text=True).stdout
    return json.loads(out)[0]


def image_size(image: str, container: Container, build_s: float | None) -> str:
    info = inspect(image)
    # torch first: du counts a directory once, so the venv's line is what is left
    sizes = container.sh("du -sm /opt/venv/lib/python3*/site-packages/torch /opt/venv | cut -f1").stdout.split()
    torch_mb, rest_mb = (int(x) for x in sizes) if len(sizes) == 2 else (0, 0)
    venv = torch_mb + rest_mb
    built = f"; built in {build_s:.0f} s" if build_s is not None else ""
    return (f"{info['Size'] / 1e9:.2f} GB in {len(info['RootFS']['Layers'])} layers "
            f"(the venv {venv / 1e3:.2f} GB, torch {torch_mb / 1e3:.2f} GB of it){built}")


def user(image: str, container: Container) -> str:
    wanted = {(p["securityContext"]["runAsUser"], p["securityContext"]["runAsGroup"]) for p in chart_pods()}
    if len(wanted) != 1:
        raise AssertionError(f"the chart's pods run as more than one user: {sorted(wanted)}")
    (uid, gid), = wanted
    configured = inspect(image)["Config"].get("User", "")
    if configured != f"{uid}:{gid}":
        raise AssertionError(f"the image's USER is {configured!r}; the chart runs as {uid}:{gid}")
    ids = container.sh("id -u; id -g").stdout.split()
    if ids != [str(uid), str(gid)]:
        raise AssertionError(f"a command in the image runs as {ids}, not {uid}:{gid}")
    return f"USER {configured}, as the chart's securityContext (runAsUser {uid}, runAsGroup {gid})"


def chart_commands(container: Container) -> str:
    commands = set()
    for pod in chart_pods():
        for c in pod.get("initContainers", []) + pod["containers"]:
            commands.add(tuple(c["command"]))
    for command in sorted(commands):
        found = container.sh(f"command -v {shlex.quote(command[0])}")
        if found.returncode != 0:
            raise AssertionError(f"the chart runs {command[0]!r}, which is not in the image")
        helped = container.sh(shlex.join([*command, "--help"]))
        if helped.returncode != 0:
            raise AssertionError(f"`{shlex.join(command)} --help` failed in the image: {helped.stderr[-500:]}")
    return ", ".join(shlex.join(c) for c in sorted(commands)) + ": found, --help answers"


def no_build_leftovers(container: Container) -> str:
    script = "; ".join([*(f"command -v {c} >/dev/null && echo compiler: {c}" for c in COMPILERS),
                        *(f"for p in {p}; do [ -e \"$p\" ] && echo left: $p; done" for p in BUILD_LEFTOVERS),
                        # Debian's venv module keeps pip's own wheels in /usr/share/python-wheels
                        "find / -xdev -path /usr/share/python-wheels -prune -o \\( -name '*.whl' -o -name '*.gguf' \\)"
                        " -print 2>/dev/null | sed 's/^/left: /'",
                        "true"])
    found = container.sh(script, user="0:0")
    if found.returncode != 0 or found.stdout.strip():
        raise AssertionError(found.stdout.strip() or found.stderr[-500:])
    return f"no {', '.join(COMPILERS)}; no pip/apt cache, sources, wheels or model files"


def serving_address(log_path: str) -> str | None:
    """The coordinator's address, once `specdec up` has said all three serve."""
    with open(log_path) as f:
        line = next((line for line in f if line.startswith(UP_LINE)), None)
    return line[len(UP_LINE):].split()[0] if line else None


def generate_from_outside(container: Container, timeout_s: float) -> str:
    shared = tempfile.mkdtemp(prefix="specdec-image-")
    os.chmod(shared, 0o777)  # the container's user writes its pid here
    # Port 0: the coordinator takes a free port and `specdec up` names it once all three serve.
    up = "echo $$ > /shared/up.pid; exec specdec up --pair tiny --host 127.0.0.1 --port 0"
    log_path = os.path.join(shared, "up.log")
    log = open(log_path, "w")
    process = subprocess.Popen(container.command(up, mounts=(f"{shared}:/shared",)), stdout=log,
                               stderr=subprocess.STDOUT)
    try:
        started = time.perf_counter()
        while not (address := serving_address(log_path)):
            if process.poll() is not None:
                raise RuntimeError(f"specdec up exited with {process.returncode} before serving")
            if time.perf_counter() - started > timeout_s:
                raise TimeoutError(f"specdec up not serving after {timeout_s:.0f} s")
            time.sleep(0.2)
        ready_s = time.perf_counter() - started
        drafted, differing = greedy_runs(address, gamma=4)
        if differing:
            prompt, spec, target = differing[0]
            raise AssertionError(f"greedy output differs from target-only on {prompt!r}: {spec} vs {target}")
        if drafted == 0:
            raise AssertionError("nothing was drafted at gamma 4: the comparison proves nothing")
        with open(os.path.join(shared, "up.pid")) as f:
            os.kill(int(f.read()), signal.SIGTERM)
        code = process.wait(timeout=60)
        if code != 0:
            raise AssertionError(f"specdec up exited with {code} on SIGTERM")
        return (f"serving {ready_s:.0f} s after start; {len(GREEDY_PROMPTS)}/{len(GREEDY_PROMPTS)} prompts identical, "
                f"{drafted} tokens drafted; SIGTERM: exit 0")
    except BaseException:
        with open(log_path) as f:
            print(f"--- specdec up in the image, its log ---\n{f.read()[-4000:]}", file=sys.stderr)
        raise
    finally:
        if process.poll() is None:
            container.kill_all()
            process.kill()
            process.wait()
        log.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--image", required=True)
    parser.add_argument("--build-seconds", type=float, help="the build's time, for the table")
    parser.add_argument("--ready-timeout", type=float, default=300.0)
    args = parser.parse_args()
    container = Container(args.image)
    checks = [("image", lambda: image_size(args.image, container, args.build_seconds)),
              ("non-root user", lambda: user(args.image, container)),
              ("the chart's commands", lambda: chart_commands(container)),
              ("no compiler or build cache", lambda: no_build_leftovers(container)),
              ("specdec up --pair tiny, Generate from outside", lambda: generate_from_outside(container,
                                                                                             args.ready_timeout))]
    try:
        return run_checks("image_check", args.image, checks)
    finally:
        container.remove()


if __name__ == "__main__":
    sys.exit(main())
