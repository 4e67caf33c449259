"""The models the GPU check times: the qwen-coder pair (0.5B draft, 1.5B target)
and a 7B-class target of the same family, each a directory of config.json and
the shared tokenizer, built by the model services with random weights
(specdec.weights.synthetic; step time does not depend on the values).

On a GPU they have their real shapes, from the payload (.gpu/, made by
scripts/gpu_payload.sh from the pulled pair). On the CPU, or where there is no
payload, the same checks run on small shapes of the same family: two layers,
a few heads, and (without the payload's tokenizer) the tiny tokenizer, each
model's vocabulary padded as its real one is, so unequal paddings are exercised.
"""
from __future__ import annotations

import copy
import json
import pathlib
from dataclasses import dataclass

from specdec.weights import pairs, synthetic

PAIR = pairs.PAIRS["qwen-coder"]
DRAFT, TARGET, TARGET_7B = PAIR.draft, PAIR.target, "qwen2.5-coder-7b-instruct"

# Qwen2.5-Coder-7B-Instruct's shape, over the 1.5B's config (same family, same tokenizer):
# its embedding pads the vocabulary to 152,064 rows where the 0.5B and 1.5B pad to 151,936.
SEVEN_B = dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
               intermediate_size=18944, rms_norm_eps=1e-6, tie_word_embeddings=False, vocab_size=152064,
               max_window_layers=28)
SEVEN_B_ROPE_THETA = 1_000_000.0

# Published shapes of the three, for a run without the payload (small shapes only).
FALLBACK = {
    DRAFT: dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                intermediate_size=4864, vocab_size=151936),
    TARGET: dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                 intermediate_size=8960, vocab_size=151936),
    TARGET_7B: {k: SEVEN_B[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                        "num_key_value_heads", "intermediate_size", "vocab_size")},
}


def seven_b_config(target_config: dict) -> dict:
    """The 7B's config.json: the 1.5B's, with the 7B's shape."""
    config = {**copy.deepcopy(target_config), **SEVEN_B, "_model_name_or_path": "Qwen2.5-Coder-7B-Instruct"}
    config.setdefault("rope_parameters", {"rope_type": "default"})["rope_theta"] = SEVEN_B_ROPE_THETA
    return _layers(config, SEVEN_B["num_hidden_layers"])


def _layers(config: dict, layers: int) -> dict:
    config["num_hidden_layers"] = layers
    if "layer_types" in config:  # one entry a layer
        config["layer_types"] = ["full_attention"] * layers
    return config


def small(config: dict, tokenizer_vocab: int, padding: int) -> dict:
    """The same family at a shape a 2-core CPU runs in seconds: two layers, the
    head size kept, one KV head per two query heads, and the vocabulary padded by
    `padding` rows past the tokenizer's (rounded to 8)."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_heads = max(1, config["num_key_value_heads"] // 2)
    shrunk = {**copy.deepcopy(config), "num_attention_heads": 2 * kv_heads, "num_key_value_heads": kv_heads,
              "hidden_size": 2 * kv_heads * head_dim, "intermediate_size": 4 * kv_heads * head_dim,
              "vocab_size": -(-(tokenizer_vocab + padding) // 8) * 8}
    return _layers(shrunk, 2)


@dataclass(frozen=True)
class Model:
    name: str
    path: pathlib.Path   # config.json and the tokenizer's files: a service's --model
    parameters: float    # billions, from the config


def parameters(config: dict) -> float:
    hidden, inter, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    attention = hidden * head_dim * (2 * heads + 2 * kv)
    embeddings = config["vocab_size"] * hidden * (1 if config.get("tie_word_embeddings") else 2)
    return (layers * (attention + 3 * hidden * inter) + embeddings) / 1e9


def prepare(payload: pathlib.Path | None, out: pathlib.Path, full_shapes: bool) -> dict[str, Model]:
    """The three models as service directories under `out`: real shapes (`full_shapes`,
    which needs the payload) or small ones; the payload's tokenizer where there is one,
    else the tiny tokenizer."""
    have_payload = payload is not None and (payload / "tokenizer").is_dir()
    if full_shapes and not have_payload:
        raise FileNotFoundError(f"real shapes need the payload's configs and tokenizer ({payload}/); run "
                                "scripts/gpu_payload.sh first")
    if have_payload:
        tokenizer = payload / "tokenizer"
        configs = {name: json.loads((payload / "models" / name / "config.json").read_text())
                   for name in (DRAFT, TARGET, TARGET_7B)}
    else:
        from specdec.weights import tiny
        tokenizer = out / "tiny-tokenizer"
        tiny.build_tokenizer().save_pretrained(tokenizer)
        from transformers import Qwen2Config
        ids = tiny._config(tiny.build_tokenizer(), 2)  # the tiny tokenizer's special ids
        configs = {name: Qwen2Config(**dims, tie_word_embeddings=False, eos_token_id=ids.eos_token_id,
                                     pad_token_id=ids.pad_token_id, architectures=["Qwen2ForCausalLM"]).to_dict()
                   for name, dims in FALLBACK.items()}
    if not full_shapes:
        vocab = _tokenizer_vocab(tokenizer)
        least = min(c["vocab_size"] for c in configs.values())
        configs = {name: small(c, vocab, c["vocab_size"] - least + 8) for name, c in configs.items()}
    models = {}
    for name, config in configs.items():
        path = synthetic.write_model_dir(out / name, config, tokenizer)
        if have_payload and (payload / "models" / name / "generation_config.json").exists():
            (path / "generation_config.json").write_bytes((payload / "models" / name / "generation_config.json")
                                                          .read_bytes())
        models[name] = Model(name, path, parameters(config))
    return models


def _tokenizer_vocab(tokenizer_dir: pathlib.Path) -> int:
    from transformers import AutoTokenizer
    vocab = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True).get_vocab()
    return max(vocab.values()) + 1
