"""The folders show the layers: protos -> core (specdec) -> services (drafter,
verifier, coordinator) -> tools (specdec.tools). Imports only go down, and the
client side of the CLI starts without torch."""
from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
SERVICES = ("drafter", "verifier", "coordinator")


def imports(path: pathlib.Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def layer(module: str) -> str | None:
    top = module.split(".")[0]
    if module.startswith("specdec.tools"):
        return "tools"
    return "core" if top == "specdec" else top if top in SERVICES else None


def test_imports_only_go_down_the_layers():
    violations = []
    for path in [*ROOT.glob("specdec/**/*.py"), *(p for s in SERVICES for p in ROOT.glob(f"{s}/*.py"))]:
        here = layer(".".join(path.relative_to(ROOT).with_suffix("").parts))
        for module in imports(path):
            there = layer(module)
            if there is None or there == here:
                continue
            if here == "core" and there != "core":
                violations.append(f"{path.relative_to(ROOT)} (core) imports {module}")
            if here in SERVICES and there not in ("core",):
                violations.append(f"{path.relative_to(ROOT)} ({here}) imports {module}")
    assert violations == []


def test_the_client_side_of_the_cli_starts_without_torch():
    code = ("import sys\nfrom specdec.tools import cli\n"
            "try:\n    cli.main(['generate', '--addr', '127.0.0.1:1', '--prompt', 'x', '--timeout', '1'])\n"
            "except SystemExit as exit:\n    code = exit.code\n"
            "print(code, 'torch' in sys.modules, 'transformers' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.stdout.split() == ["1", "False", "False"], result.stderr
    assert "UNAVAILABLE" in result.stderr
