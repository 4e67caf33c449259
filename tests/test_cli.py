"""The `specdec` command and the services as real subprocesses."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

import drafter.service
from specdec_tools import launcher
from specdec.runtime.models import load_model
from tests.conftest import free_port, model_draft_tokens

ENV = dict(os.environ, PYTHONUNBUFFERED="1", SPECDEC_TEST_TOKEN="cli-test-token")


def child_pids(parent: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == parent:
                        pids.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return pids


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def specdec(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specdec_tools.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=ENV)


@pytest.fixture
def mismatched_drafter():
    running = drafter.service.serve(load_model("tiny-mismatch-draft"))
    yield f"127.0.0.1:{running.port}"
    running.stop(0)


@pytest.mark.integration
def test_coordinator_refuses_mismatched_tokenizers(stack, mismatched_drafter):
    result = subprocess.run(
        [sys.executable, "-m", "coordinator", "--drafter", mismatched_drafter,
         "--verifier", stack.address(stack.verifier), "--port", "0", "--connect-timeout", "30"],
        capture_output=True, text=True, timeout=120, env=ENV)
    assert result.returncode == 2
    assert ("draft (tiny-mismatch-draft) and target (tiny-target) tokenizers differ: same tokens in a different "
            "id order; id 0: draft '<|im_end|>' vs target '<|endoftext|>'") in result.stderr


@pytest.mark.integration
def test_up_generate_and_stop():
    port = free_port()
    auth = ("--auth-token-env", "SPECDEC_TEST_TOKEN")
    up = subprocess.Popen([sys.executable, "-m", "specdec_tools.cli", "up", "--pair", "tiny", "--port", str(port), *auth],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        line = up.stdout.readline()
        assert f"coordinator on 127.0.0.1:{port}" in line, (line, up.stderr.read() if up.poll() else "")
        anonymous = specdec("generate", "--addr", f"127.0.0.1:{port}", "--prompt", "def add(a, b):")
        assert anonymous.returncode == 1 and "UNAUTHENTICATED" in anonymous.stderr
        result = specdec("generate", "--addr", f"127.0.0.1:{port}", "--prompt", "def add(a, b):",
                         "--max-new-tokens", "12", "--json", *auth)
        assert result.returncode == 0, result.stderr
        response = json.loads(result.stdout)
        assert len(response["tokenIds"]) == 12 and response["finishReason"] == "FINISH_REASON_LENGTH"
        assert response["stats"]["rounds"] >= 1 and "acceptanceRate" in response["stats"]
        target_only = specdec("generate", "--addr", f"127.0.0.1:{port}", "--prompt", "def add(a, b):",
                              "--max-new-tokens", "12", "--json", "--no-speculation", *auth)
        assert json.loads(target_only.stdout)["tokenIds"] == response["tokenIds"]
        summary = specdec("generate", "--addr", f"127.0.0.1:{port}", "--prompt", "def add(a, b):",
                          "--max-new-tokens", "12", "--stats", *auth)
        assert summary.returncode == 0 and "first token" in summary.stderr and "drafted" in summary.stderr
        model_only = specdec("generate", "--addr", f"127.0.0.1:{port}", "--prompt", "def add(a, b):",
                             "--max-new-tokens", "12", "--json", "--proposer", "model", "--gamma", "3", *auth)
        sources = json.loads(model_only.stdout)["stats"].get("draftSources", [])
        assert json.loads(model_only.stdout)["tokenIds"] == response["tokenIds"]
        assert sources and {d["source"] for d in sources} == {"model"}
        streamed = specdec("generate", "--addr", f"127.0.0.1:{port}", "--prompt", "def add(a, b):",
                           "--max-new-tokens", "12", "--stream", *auth)
        assert streamed.returncode == 0 and streamed.stdout.strip() == response["text"].strip()
        bad = specdec("generate", "--addr", f"127.0.0.1:{port}", "--prompt", "x", "--top-p", "2", *auth)
        assert bad.returncode == 1 and "INVALID_ARGUMENT: top_p must be in (0, 1], got 2" in bad.stderr
    finally:
        children = child_pids(up.pid)
        up.send_signal(signal.SIGTERM)
        code = up.wait(60)
    assert code == 0
    # The three services, and their standbys (spares with their imports done, for restarts).
    assert len(children) >= 3 and not any(alive(pid) for pid in children), "a service outlived `specdec up`"


@pytest.mark.integration
def test_up_with_a_mismatched_pair_exits_and_names_the_difference():
    result = specdec("up", "--pair", "tiny-mismatch", "--port", str(free_port()))
    assert result.returncode == 2
    assert "id 0: draft '<|im_end|>' vs target '<|endoftext|>'" in result.stderr
    assert "coordinator exited with code 2" in result.stderr


def test_up_with_the_gpu_pair_and_no_target_directory_says_where_to_get_the_target():
    result = specdec("up", "--pair", "qwen-coder-7b", "--port", str(free_port()))
    assert result.returncode == 2
    assert "download Qwen/Qwen2.5-Coder-7B-Instruct" in result.stderr and "--target-model DIR" in result.stderr
    assert "GPU pair (--device cuda)" in result.stderr


def child_running(up_pid: int, *words: str) -> int | None:
    """A live child of `specdec up` whose command line has `words` in a row."""
    wanted = [w.encode() for w in words]
    for pid in child_pids(up_pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if alive(pid) and any(argv[i : i + len(wanted)] == wanted for i in range(len(argv))):
            return pid
    return None


def service_pid(up_pid: int, module: str) -> int | None:
    return child_running(up_pid, "-m", module)


def standby_pid(up_pid: int, module: str) -> int | None:
    """`specdec up`'s spare for `module` (python -m specdec_tools.standby MODULE)."""
    return child_running(up_pid, "-m", "specdec_tools.standby", module)


@pytest.mark.integration
def test_up_serves_the_models_on_private_sockets_and_restarts_what_dies(tmp_path):
    import grpc
    import psutil
    import urllib.request
    from specdec.v1 import coordinator_pb2 as pb, coordinator_pb2_grpc
    from tests.conftest import wait_for

    port, metrics_port = free_port(), free_port()
    up = subprocess.Popen([sys.executable, "-m", "specdec_tools.cli", "up", "--pair", "tiny", "--port", str(port),
                           "--metrics-port", str(metrics_port), "--drafter-timeout", "5"],
                          stdout=subprocess.PIPE, stderr=(tmp_path / "stderr").open("w"), text=True, env=ENV)
    request = pb.GenerateRequest(prompt="Once upon a time", max_new_tokens=40, ignore_eos=True,
                                 speculation=pb.Speculation(gamma=4))
    try:
        assert f"coordinator on 127.0.0.1:{port}" in up.stdout.readline()
        models_line = up.stdout.readline()
        addresses = dict(part.strip().split(" on ") for part in models_line.split(":", 1)[1].split(","))
        sockets = {name: address.removeprefix("unix:") for name, address in addresses.items()}
        assert set(sockets) == {"drafter", "verifier"} and all(a.startswith("unix:") for a in addresses.values())
        # The OpenAI-compatible API is on too, at vLLM's port 8000 or, where that is taken, a free one.
        http_url = up.stdout.readline().split("OpenAI-compatible API on ", 1)[1].strip()
        with urllib.request.urlopen(http_url + "/models", timeout=10) as reply:
            assert [m["id"] for m in json.load(reply)["data"]] == ["tiny-target"]
        directory = os.path.dirname(sockets["drafter"])
        assert os.stat(directory).st_mode & 0o777 == 0o700  # only this user can reach the model services
        for module in ("drafter", "verifier"):  # and they listen on no TCP port at all
            listening = [c for c in psutil.Process(service_pid(up.pid, module)).net_connections("tcp")
                         if c.status == psutil.CONN_LISTEN]
            assert listening == [], (module, listening)
        # --metrics-port reached the coordinator.
        assert b"specdec_rounds" in urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics").read()
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = coordinator_pb2_grpc.CoordinatorStub(ch)
            reference = list(stub.Generate(request, timeout=60).token_ids)

            def generate() -> pb.GenerateResponse | None:
                try:
                    return stub.Generate(request, timeout=30)
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc.details()
                    return None
            for module in ("drafter", "verifier"):
                old = service_pid(up.pid, module)
                # Its standby has done its imports: the restart takes it over.
                assert wait_for(lambda: standby_pid(up.pid, module) is not None, 30), module
                spare = standby_pid(up.pid, module)
                os.kill(old, signal.SIGKILL)
                # Restarted at the same socket; the stack serves on, and speculates again once it is back.
                assert wait_for(lambda: f"specdec up: {module} restarted (pid {spare}," in
                                (tmp_path / "stderr").read_text(), 30), module
                assert wait_for(lambda: (r := generate()) is not None and model_draft_tokens(r.stats) > 0
                                and list(r.token_ids) == reference, 60), module
                # `up` says so once its own check sees it serving (the coordinator may see it first).
                assert wait_for(lambda: f"specdec up: {module} is back" in (tmp_path / "stderr").read_text(), 30)
                assert up.poll() is None
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(60)
    err = (tmp_path / "stderr").read_text()
    assert up.returncode == 0, err
    for module in ("drafter", "verifier"):
        # A child that ran healthy comes back at once (a crash loop backs off: Backoff).
        assert f"specdec up: {module} (pid" in err and "exited with code -9; restarting in 0.0 s" in err
        assert f"specdec up: {module} is back on unix:{sockets[module]}" in err
    assert not os.path.exists(directory)


def test_up_hands_the_coordinator_its_flags():
    from specdec_tools.cli import coordinator_passthrough, parser
    args = parser().parse_args(["up", "--pair", "tiny", "--metrics-port", "9100", "--drafter-timeout", "5",
                                "--max-message-bytes", "1000000", "--health-port", "9101", "--max-sessions", "3",
                                "--proposer", "ngram", "--draft-top-k", "32", "--lookup-history-tokens", "0"])
    passed = coordinator_passthrough(args)
    pairs = dict(zip(passed[::2], passed[1::2]))
    assert pairs == {"--metrics-port": "9100", "--drafter-timeout": "5.0", "--max-message-bytes": "1000000",
                     "--health-port": "9101", "--max-sessions": "3", "--proposer": "ngram", "--draft-top-k": "32",
                     "--lookup-history-tokens": "0"}


@pytest.mark.integration
def test_up_over_tcp_gives_the_model_services_a_token_only_the_stack_holds():
    import grpc
    from specdec.rpc.serving import channel
    from specdec.v1 import common_pb2, coordinator_pb2 as pb, coordinator_pb2_grpc, drafter_pb2_grpc, \
        verifier_pb2_grpc
    port = free_port()
    up = subprocess.Popen([sys.executable, "-m", "specdec_tools.cli", "up", "--pair", "tiny", "--port", str(port),
                           "--model-transport", "tcp"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                          env=ENV)
    try:
        assert f"coordinator on 127.0.0.1:{port}" in up.stdout.readline()
        models_line = up.stdout.readline()
        addresses = dict(part.strip().split(" on ") for part in models_line.split(":", 1)[1].split(","))
        assert all(a.startswith("127.0.0.1:") for a in addresses.values()), addresses
        for name, stub_cls in (("drafter", drafter_pb2_grpc.DrafterStub), ("verifier", verifier_pb2_grpc.VerifierStub)):
            with channel(addresses[name]) as ch:  # another local user, without the stack's token
                with pytest.raises(grpc.RpcError) as refused:
                    stub_cls(ch).StartSession(common_pb2.StartSessionRequest(session_id="x", prompt_token_ids=[1, 2]),
                                              timeout=10)
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:  # the coordinator holds it
            response = coordinator_pb2_grpc.CoordinatorStub(ch).Generate(pb.GenerateRequest(
                prompt="Once upon a time", max_new_tokens=12, speculation=pb.Speculation(gamma=4)), timeout=60)
        assert len(response.token_ids) > 0 and response.stats.draft_tokens > 0
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(60)
    assert up.returncode == 0


@pytest.mark.integration
def test_the_demo_script_serves_a_sample_and_stops_the_stack_it_started():
    env = dict(ENV, PORT=str(free_port()), PATH=f"{os.path.dirname(sys.executable)}:{os.environ.get('PATH', '')}")
    demo = subprocess.Popen(["bash", "scripts/demo.sh", "--pair", "tiny"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    out, err = demo.communicate(timeout=180)
    assert demo.returncode == 0, err[-2000:]
    assert out.strip() and "tok/s" in err  # the sample's text, then its stats line
    # Nothing it started outlives it.
    def in_its_group(pid: int) -> bool:
        try:
            return os.getpgid(pid) == demo.pid and alive(pid)
        except OSError:  # gone meanwhile
            return False
    leftovers = [pid for pid in map(int, filter(str.isdigit, os.listdir("/proc"))) if in_its_group(pid)]
    assert leftovers == [], leftovers


def test_a_child_that_keeps_exiting_is_restarted_later_each_time():
    backoff = launcher.Backoff()
    assert [backoff.delay(n) for n in range(4)] == [0.0, 0.5, 1.0, 2.0]   # the first at once
    assert backoff.delay(20) == backoff.max_s
