"""The folders show the layers. From the bottom: the generated protos
(specdec.v1); inside the core, one folder per concern, each importing only the
folders below it: rpc (errors, serving, security, sessions, telemetry) -> spec
(sampling, proposers, rejection sampler, wire forms) -> weights (where weights and
tokenizers come from) -> runtime (models, the lean forward, quantized layers, KV
caches, batching) -> service (what both model services share); then the services
(drafter, verifier, coordinator), each on its own; then the tools (specdec_tools).
Imports only go down; no core folder is flat module soup; the client side of the
CLI starts without torch."""
from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
CORE = ("v1", "rpc", "spec", "weights", "runtime", "service")   # bottom to top
SERVICES = ("drafter", "verifier", "coordinator")
FLOORS = [*(f"specdec.{c}" for c in CORE), "services", "specdec_tools"]


def imports(path: pathlib.Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def floor(module: str) -> tuple[int, str] | None:
    """(height, name) of a project module's layer; None for third-party modules."""
    parts = module.split(".")
    if parts[0] == "specdec" and len(parts) > 1 and parts[1] in CORE:
        return FLOORS.index(f"specdec.{parts[1]}"), f"specdec.{parts[1]}"
    if parts[0] in SERVICES:
        return FLOORS.index("services"), parts[0]
    if parts[0] == "specdec_tools":
        return FLOORS.index("specdec_tools"), "specdec_tools"
    return None


def project_modules() -> list[pathlib.Path]:
    return [p for p in [*ROOT.glob("specdec/**/*.py"), *ROOT.glob("specdec_tools/**/*.py"),
                        *(p for s in SERVICES for p in ROOT.glob(f"{s}/**/*.py"))] if "__pycache__" not in p.parts]


def test_imports_only_go_down_the_layers():
    violations = []
    for path in project_modules():
        here = floor(".".join(path.relative_to(ROOT).with_suffix("").parts))
        if here is None:  # specdec/__init__.py
            continue
        for module in imports(path):
            there = floor(module)
            if there is None or there[1] == here[1]:
                continue
            if there[0] >= here[0]:  # sideways (one service importing another) counts as upward
                violations.append(f"{path.relative_to(ROOT)} ({here[1]}) imports {module} ({there[1]})")
    assert violations == []


def test_the_core_has_no_flat_modules_and_no_module_is_over_400_lines():
    flat = sorted(p.name for p in (ROOT / "specdec").glob("*.py") if p.name != "__init__.py")
    assert flat == [], f"modules outside a concern's folder: {flat}"
    written = [*project_modules(), *(p for d in ("tests", "benchmarks", "scripts") for p in ROOT.glob(f"{d}/*.py"))]
    long = {str(p.relative_to(ROOT)): n for p in written if "v1" not in p.parts   # v1: generated
            and (n := len(p.read_text().splitlines())) > 400}
    assert long == {}, long


def test_the_client_side_of_the_cli_starts_without_torch():
    code = ("import sys\nfrom specdec_tools import cli\n"
            "try:\n    cli.main(['generate', '--addr', '127.0.0.1:1', '--prompt', 'x', '--timeout', '1'])\n"
            "except SystemExit as exit:\n    code = exit.code\n"
            "print(code, 'torch' in sys.modules, 'transformers' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.stdout.split() == ["1", "False", "False"], result.stderr
    assert "UNAVAILABLE" in result.stderr


def test_the_coordinators_process_runs_requests_without_torch(stack):
    """The coordinator runs no model: its process (and image layer) needs no torch,
    through start-up, the tokenizer check, and greedy, sampled and chat requests."""
    code = f"""
import sys
from coordinator.service import CoordinatorConfig, serve
from specdec.rpc.serving import channel
from specdec.v1 import common_pb2, coordinator_pb2 as pb, coordinator_pb2_grpc
running, backends = serve(CoordinatorConfig(drafter="{stack.address(stack.drafter)}",
                                            verifier="{stack.address(stack.verifier)}", connect_timeout_s=30))
with channel(f"127.0.0.1:{{running.port}}") as ch:
    stub = coordinator_pb2_grpc.CoordinatorStub(ch)
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")])
    for request in (pb.GenerateRequest(prompt="Once upon a time", max_new_tokens=8, speculation=pb.Speculation(gamma=3)),
                    pb.GenerateRequest(messages=chat, max_new_tokens=8,
                                       sampling=common_pb2.SamplingParams(temperature=0.7, seed=1))):
        assert len(stub.Generate(request, timeout=60).token_ids) > 0
backends.close()
running.stop(0)
print("torch" in sys.modules)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.stdout.split() == ["False"], result.stderr[-3000:]


def test_every_measurement_script_imports():
    """The scripts and benchmarks sit on top of everything: a move in the layers must not break them unnoticed."""
    import importlib.util
    paths = sorted((ROOT / "scripts").glob("*.py")) + sorted((ROOT / "benchmarks").glob("*.py"))
    assert len(paths) >= 8, paths   # a moved folder must not leave this test checking nothing
    for path in paths:
        spec = importlib.util.spec_from_file_location(f"{path.parent.name}_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module   # as importlib's recipe does: dataclasses look their module up
        sys.path.insert(0, str(path.parent))
        try:
            spec.loader.exec_module(module)   # defines main(); runs nothing under __main__
        finally:
            sys.path.remove(str(path.parent))
        assert hasattr(module, "main"), path.name
