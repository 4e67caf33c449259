"""The `tiny` model pair, built deterministically from a seed: no files to ship.

A byte-level BPE tokenizer is trained with `tokenizers` on a text in the repo,
and two random-weight Llama models are built on it. The draft is the target's
first layers with the target's embeddings, final norm and head, so its proposals
agree with the target often but not always: tests see both acceptance and
rejection. `tiny-mismatch-draft` has the same tokens in a different id order, to
exercise the tokenizer-identity refusal. The embedding matrix is padded beyond
the tokenizer, as real checkpoints' often are, so masking is exercised too.
"""
from __future__ import annotations

import functools
import importlib.resources

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

TINY_SEED = 20260101
TOKENIZER_VOCAB = 512
PADDED_VOCAB = 520           # embedding rows; ids 512..519 are never sampled
TARGET_LAYERS = 4
DRAFT_LAYERS = 2
INIT_RANGE = 0.25            # large enough that a random model has peaked, not flat, distributions
# The target's layers past the draft's write this fraction of a random layer's
# output into the residual stream: greedy agreement of the draft is then about
# 0.7 (about 0.4 at 0.3, 0.85 at 0.1), measured over 4 prompts x 40 tokens.
DEEP_LAYER_SCALE = 0.2
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TINY_NAMES = ("tiny-target", "tiny-draft", "tiny-mismatch-draft")


@functools.lru_cache(maxsize=None)
def _backend(specials: tuple[str, ...]) -> str:
    corpus = importlib.resources.files("specdec.data").joinpath("tiny_corpus.txt").read_text("utf-8")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB, special_tokens=list(specials), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus.splitlines(keepends=True), trainer)
    return tokenizer.to_str()


def build_tokenizer(mismatch: bool = False) -> PreTrainedTokenizerFast:
    # The mismatch variant lists the special tokens in another order: the same
    # tokens, different ids — the case a vocab-size check would miss.
    specials = tuple(reversed(SPECIALS)) if mismatch else tuple(SPECIALS)
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_backend(specials)),
        eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE)


def _config(tokenizer: PreTrainedTokenizerFast, layers: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=PADDED_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        initializer_range=INIT_RANGE, tie_word_embeddings=False,
        eos_token_id=[tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")],
        pad_token_id=tokenizer.pad_token_id, bos_token_id=None)


def _target(tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(TINY_SEED)
        model = LlamaForCausalLM(_config(tokenizer, TARGET_LAYERS))
    with torch.no_grad():
        for layer in model.model.layers[DRAFT_LAYERS:]:
            layer.self_attn.o_proj.weight.mul_(DEEP_LAYER_SCALE)
            layer.mlp.down_proj.weight.mul_(DEEP_LAYER_SCALE)
    return model.eval()


def build(name: str) -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast]:
    """(model, tokenizer) for one of TINY_NAMES, fp32 on the CPU."""
    if name not in TINY_NAMES:
        raise ValueError(f"unknown tiny model {name!r}; known: {', '.join(TINY_NAMES)}")
    tokenizer = build_tokenizer(mismatch=name == "tiny-mismatch-draft")
    target = _target(build_tokenizer())
    if name == "tiny-target":
        return target, tokenizer
    draft = LlamaForCausalLM(_config(tokenizer, DRAFT_LAYERS)).eval()
    # Everything but the dropped layers comes from the target, weight for weight.
    missing, unexpected = draft.load_state_dict(target.state_dict(), strict=False)
    assert not missing, missing
    assert all(k.startswith("model.layers.") for k in unexpected), unexpected
    return draft, tokenizer
