"""Model loading: an HF directory, a GGUF file, or a registry name.

No machine here reaches a model hub, so nothing is ever loaded by hub id: a
name that is neither a local path nor a registry entry is refused with a
message saying what is accepted.
"""
from __future__ import annotations

import hashlib
import json
import logging
import pathlib
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from specdec.runtime.device import DevicePolicy, policy
from specdec.runtime.options import COMPILE, DTYPES, FORWARDS
from specdec.runtime.quant import QUANTIZE, quantizations
from specdec.runtime.quant.base import QuantizeContext

from specdec.runtime import lean, model_cache, torch_thread
from specdec.runtime.paged_forward import PagedForward
from specdec.runtime.paged_step import toolchain_missing

from specdec.weights import registry, synthetic, tiny, vocab_rank
from specdec.rpc.errors import FailedPrecondition, InvalidArgument
from specdec.weights.tokenizer_fingerprint import tokenizer_fingerprint

log = logging.getLogger(__name__)

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
assert tuple(TORCH_DTYPES) == DTYPES




@dataclass
class LoadedModel:
    """A model ready for inference, and the facts the services report about it."""
    name: str
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    dtype: str
    device: torch.device
    quantization: str
    vocab_size: int            # tokenizer ids; logits beyond are masked
    model_vocab_size: int      # embedding rows (may be padded)
    max_context: int
    eos_token_ids: tuple[int, ...]
    fingerprint: str
    lean: lean.LeanForward | None = None  # None: transformers' forward
    # What its weights and layers are made from (name, settings, converted form): the key
    # under which what a service times on it is kept (specdec.service.start_profile).
    identity: str = ""

    @property
    def policy(self) -> DevicePolicy:
        """What running on its device means for the code that runs it (specdec.runtime.device)."""
        return policy(self.device)


def _eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    ids: list[int] = []
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        ids += value if isinstance(value, list) else [value] if value is not None else []
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return tuple(sorted(set(int(i) for i in ids)))


def _source(name: str) -> pathlib.Path | None:
    """The HF directory or .gguf file a model name stands for, pulling a registry
    model first; None for the tiny models, which are built, not loaded."""
    if name in tiny.TINY_NAMES:
        return None
    path = registry.pull(name) if name in registry.MODELS else pathlib.Path(name).expanduser()
    if (path.is_dir() and (path / "config.json").exists()) or (path.is_file() and path.suffix == ".gguf"):
        return path
    raise InvalidArgument(
        f"cannot load model {name!r}: expected an HF model directory (with config.json), a .gguf file, "
        f"or a registry name ({', '.join([*registry.MODELS, *tiny.TINY_NAMES])}); models are never fetched "
        "from a hub")


def _from_pretrained(cls, path: pathlib.Path, **kwargs):
    if path.is_dir():
        return cls.from_pretrained(path, local_files_only=True, **kwargs)
    return cls.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True, **kwargs)


def _load_weights(name: str, source: pathlib.Path | None, torch_dtype: torch.dtype, device: torch.device,
                  random_weights: int | None) -> PreTrainedModel:
    if random_weights is not None:
        return synthetic.build(source, random_weights, torch_dtype, device)
    if source is None:
        return tiny.build(name)[0].to(torch_dtype)
    return _from_pretrained(AutoModelForCausalLM, source, dtype=torch_dtype)


def _load_tokenizer(name: str, source: pathlib.Path | None) -> PreTrainedTokenizerBase:
    if source is None:
        return tiny.build_tokenizer(mismatch=name == "tiny-mismatch-draft")
    return _from_pretrained(AutoTokenizer, source)


def _cache_root(name: str, source: pathlib.Path | None) -> pathlib.Path | None:
    """Where a model's converted forms are kept: beside a registry model, or under
    $SPECDEC_HOME for a local file (keyed by its path, size and time)."""
    if source is None:
        return None  # a tiny model: built in a second; nothing to save
    if name in registry.MODELS:
        return registry.model_dir(registry.lookup(name))
    path = source.resolve()
    stat = (path / "config.json" if path.is_dir() else path).stat()
    digest = hashlib.sha256(f"{path}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return registry.home() / "converted-local" / digest




def gguf_source(name: str) -> pathlib.Path | None:
    """The GGUF file a model's weights come from, if they come from one."""
    if name in registry.MODELS:
        entry = registry.lookup(name)
        path = registry.model_dir(entry) / entry.gguf_name
        return path if path.is_file() else None
    path = pathlib.Path(name).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None


def _quantized(name: str, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, device: torch.device,
               quantize: str, head_vocab: int, ranking) -> PreTrainedModel:
    if quantize not in quantizations():  # "none"
        return model
    special = [*tokenizer.all_special_ids, *tokenizer.added_tokens_decoder, *_eos_ids(model, tokenizer)]
    return quantizations()[quantize].apply(model, QuantizeContext(name, device, head_vocab, ranking, special,
                                                                  gguf_source(name)))


@torch_thread.runs_on_it  # see specdec.runtime.torch_thread: the process's torch work stays on one thread
def load_model(name: str, *, dtype: str = "fp32", device: str = "cpu", quantize: str = "none",
               head_vocab: int = 0, forward: str = "lean", random_weights: int | None = None,
               compile: str = "off") -> LoadedModel:
    """`random_weights`: a benchmark's model, `name` a directory with config.json and the
    tokenizer, its weights drawn from this seed (specdec.weights.synthetic)."""
    if dtype not in DTYPES:
        raise InvalidArgument(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if quantize not in QUANTIZE:
        raise InvalidArgument(f"quantize must be one of {', '.join(QUANTIZE)}, got {quantize!r}")
    if forward not in FORWARDS:
        raise InvalidArgument(f"forward must be one of {', '.join(FORWARDS)}, got {forward!r}")
    if compile not in COMPILE:
        raise InvalidArgument(f"compile must be one of {', '.join(COMPILE)}, got {compile!r}")
    if compile != "off" and forward != "paged":
        raise InvalidArgument(f"--compile {compile} compiles the paged forward's static step; add --forward paged "
                              f"(the {forward} forward has no static shapes to compile)")
    torch_device = torch.device(device)
    if missing := toolchain_missing(compile, torch_device):
        raise FailedPrecondition(f"--compile {compile} on {torch_device.type} needs " + "; ".join(missing)
                                 + ": install it, or serve with --compile off")
    source = _source(name)  # pulls a registry model first, so its GGUF is there for int4
    if random_weights is not None and (source is None or not source.is_dir()):
        raise InvalidArgument(f"--random-weights builds a model from a directory's config.json; {name!r} is not one")
    quantization = quantizations().get(quantize)  # None: "none"
    if quantization is not None and quantization.needs_gguf and gguf_source(name) is None:
        raise InvalidArgument(f"--quantize int4 builds its weights from a GGUF's Q4_K blocks; {name!r} has no "
                              "GGUF source (give a .gguf file or a registry name)")
    tokenizer = _load_tokenizer(name, source)
    uses_head_vocab = quantization is not None and quantization.uses_head_vocab
    head_vocab = head_vocab if uses_head_vocab else 0
    fingerprint = tokenizer_fingerprint(tokenizer)
    ranking = vocab_rank.load(fingerprint) if head_vocab else None   # the head's ids, most frequent first
    settings = dict(quantize=quantize, dtype=dtype, head_vocab=head_vocab)
    if head_vocab:
        settings["head_ranking"] = vocab_rank.digest(ranking)
    keep = quantization is not None and policy(torch_device).keeps_converted and random_weights is None
    root = _cache_root(name, source) if keep else None
    entry = model_cache.entry_dir(root, settings) if root else None
    model = model_cache.load(entry) if entry else None
    if model is None:
        weights = _load_weights(name, source, TORCH_DTYPES[dtype], torch_device, random_weights)
        model = _quantized(name, weights.to(torch_device).eval(), tokenizer,
                           torch_device, quantize, head_vocab, ranking)
        if entry:
            try:
                model_cache.save(model, entry, settings)
            except OSError as error:
                log.warning("could not save the converted model to %s (%s); the next start converts again",
                            entry, error)
    dtype = quantization.dtype_label(dtype, torch_device) if quantization is not None else dtype
    vocab = tokenizer.get_vocab()
    vocab_size = max(vocab.values()) + 1
    model_vocab = int(model.get_input_embeddings().weight.shape[0])
    if vocab_size > model_vocab:
        raise FailedPrecondition(
            f"{name}: tokenizer has {vocab_size} ids but the model only {model_vocab} output rows")
    lean_forward = None
    if forward in ("lean", "paged"):
        if (why_not := lean.supports(model)) is None:
            lean_forward = lean.LeanForward(model) if forward == "lean" else \
                PagedForward(model, compile=None if compile == "off" else compile)
        else:
            log.info("%s: transformers' forward (%s)", name, why_not)
    loaded = LoadedModel(
        name=name, model=model, tokenizer=tokenizer, dtype=dtype, device=torch_device, quantization=quantize,
        vocab_size=vocab_size, model_vocab_size=model_vocab,
        max_context=int(getattr(model.config, "max_position_embeddings", 2048)),
        eos_token_ids=_eos_ids(model, tokenizer), fingerprint=fingerprint, lean=lean_forward,
        identity=json.dumps({"name": name, "entry": entry.name if entry else "", "forward": forward,
                             "compile": compile, "random_weights": random_weights, **settings},
                            sort_keys=True, default=str))
    log.info("loaded %s (%s, %s, quantize=%s, head_vocab=%s, vocab %d/%d, %s forward)", name, dtype, device,
             quantize, head_vocab or "all", vocab_size, model_vocab, forward if lean_forward else "transformers'")
    return loaded
