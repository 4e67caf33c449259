"""Quantized models are converted once, kept beside the model, and loaded from there."""
from __future__ import annotations

import pytest
import torch

from specdec.runtime import model_cache

from specdec.weights import tiny
from specdec.runtime.sequence import SequenceCache
from specdec.runtime.models import load_model


def logits_of(loaded, ids: list[int]) -> torch.Tensor:
    seq = SequenceCache(loaded, ids)
    return seq.forward([], keep_last=1)


@pytest.fixture
def source(tmp_path, monkeypatch):
    """The tiny target saved as a local HF directory, with the model cache in tmp_path/home."""
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    model, tokenizer = tiny.build("tiny-target")
    path = tmp_path / "tiny-target"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_a_converted_model_is_saved_once_and_loaded_the_same(tmp_path, source):

    first = load_model(str(source), quantize="int8")
    entries = list((tmp_path / "home").glob("converted-local/*/converted/int8-*/module.pt"))
    assert len(entries) == 1
    saved_at = entries[0].stat().st_mtime_ns
    second = load_model(str(source), quantize="int8")
    assert entries[0].stat().st_mtime_ns == saved_at                      # loaded, not written again
    ids = [5, 9, 33, 71, 200]
    assert torch.equal(logits_of(first, ids), logits_of(second, ids))
    assert second.dtype == "fp32+int8" and second.lean is not None

    load_model(str(source), quantize="int8", head_vocab=300)              # other settings, other entry
    assert len(list((tmp_path / "home").glob("converted-local/*/converted/int8-*/module.pt"))) == 2


def test_the_entry_key_names_the_settings_and_the_library_versions(tmp_path):
    a = model_cache.entry_dir(tmp_path, {"quantize": "int4", "dtype": "bf16"})
    assert a == model_cache.entry_dir(tmp_path, {"dtype": "bf16", "quantize": "int4"})
    assert a != model_cache.entry_dir(tmp_path, {"quantize": "int4", "dtype": "fp32"})
    assert a.name.startswith("int4-")
    model_cache.save(torch.nn.Linear(2, 2), a, {"quantize": "int4"})
    settings = (a / "settings.json").read_text()
    assert torch.__version__ in settings and f'"format": {model_cache.FORMAT}' in settings
    assert not list(a.glob("*.partial"))


def test_a_damaged_entry_is_converted_again_not_fatal(tmp_path, source):
    first = load_model(str(source), quantize="int8")
    (entry,) = (tmp_path / "home").glob("converted-local/*/converted/int8-*/module.pt")
    entry.write_bytes(b"not a module")
    again = load_model(str(source), quantize="int8")
    ids = [5, 9, 33]
    assert torch.equal(logits_of(first, ids), logits_of(again, ids))
    assert entry.stat().st_size > 1000  # saved again
