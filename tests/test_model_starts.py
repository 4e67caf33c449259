"""Each registry model starts as a service with each quantization its pairs use
(and the draft's Q4_0 on any of them, as `specdec up --draft-model` gives it),
from an empty converted cache and from a full one, in a process of its own: a
native abort (ggml asserts on memory it is handed) must never be what a user
sees. SmolLM2 (98 MB) runs in CI; the Qwen pair (1.6 GB) with -m slow."""
from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import threading

import pytest

from specdec.rpc.serving import channel
from specdec.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc
from specdec.weights import registry

pytestmark = pytest.mark.integration

STARTS = [("drafter", "smollm2-135m-instruct", "int8", 0), ("drafter", "smollm2-135m-instruct", "q4_0", 32768),
          pytest.param("drafter", "qwen2.5-coder-0.5b-instruct", "q4_0", 32768, marks=pytest.mark.slow),
          pytest.param("drafter", "qwen2.5-coder-0.5b-instruct", "int8", 32768, marks=pytest.mark.slow),
          pytest.param("verifier", "qwen2.5-coder-1.5b-instruct", "int4", 0, marks=pytest.mark.slow)]


def serve(service: str, name: str, quantize: str, head_vocab: int, home: pathlib.Path) -> tuple[subprocess.Popen, str]:
    """The service started as `specdec up` starts it (a pinned curve: no kernel timing), and its address."""
    process = subprocess.Popen(
        [sys.executable, "-m", service, "--model", name, "--quantize", quantize, "--head-vocab", str(head_vocab),
         "--dtype", "bf16" if quantize == "int4" else "fp32", "--port", "0", "--cost-curve", "10,11,12:1",
         "--prefill-weights", "unpack"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "SPECDEC_HOME": str(home)})
    lines: list[str] = []
    timer = threading.Timer(900, process.kill)
    timer.start()
    try:
        for line in process.stdout:
            lines.append(line)
            if " SERVING on " in line:
                threading.Thread(target=lambda: [None for _ in process.stdout], daemon=True).start()
                return process, line.split(" SERVING on ", 1)[1].split()[0]
    finally:
        timer.cancel()
    process.wait()
    pytest.fail(f"{service} {name} --quantize {quantize} exited with {process.returncode} before serving:\n"
                + "".join(lines[-15:]))


@pytest.mark.parametrize("service, name, quantize, head_vocab", STARTS)
def test_a_registry_model_starts_from_an_empty_converted_cache_and_from_a_full_one(tmp_path, service, name,
                                                                                  quantize, head_vocab):
    registry.pull(name, progress=False)
    real = registry.model_dir(registry.lookup(name))
    home = tmp_path / "home"
    model = registry.model_dir(registry.lookup(name), home)
    model.mkdir(parents=True)
    for entry in ("hf", registry.lookup(name).gguf_name):   # the pulled model, without its converted forms
        (model / entry).symlink_to(real / entry)
    for cache in ("empty", "full"):
        process, address = serve(service, name, quantize, head_vocab, home)
        try:
            assert process.poll() is None, cache
            if service == "drafter":
                with channel(address) as ch:
                    stub = drafter_pb2_grpc.DrafterStub(ch)
                    stub.StartSession(common_pb2.StartSessionRequest(session_id="s", prompt_token_ids=[1, 2, 3, 4]),
                                      timeout=120)
                    proposal = stub.Propose(drafter_pb2.ProposeRequest(session_id="s", num_tokens=4), timeout=120)
                    assert len(proposal.draft_token_ids) == 4, cache
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(60)
        assert process.returncode == 0, (cache, process.returncode)
        assert any((model / "converted").iterdir()), "the first start keeps its conversion for the next"
