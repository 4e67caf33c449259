#!/usr/bin/env python
"""Rank a tokenizer's ids by how often the target writes them (FR-Spec,
VocabTrim), for a draft head cut to the top N (`--head-vocab N`): the target's
greedy answers to Spec-Bench dev prompts, counted, then the prompts' own ids.
Writes specdec/weights/vocab/<fingerprint>.npy (specdec.weights.vocab_rank),
and the list of questions it read, so that a measurement of the cut head can
leave them out (`benchmarks/draft_head.py --skip-ranked`).

  python benchmarks/vocab_rank.py --pair qwen-coder --every 2 --tokens 96
"""
from __future__ import annotations

import argparse
import collections
import json
import pathlib
import sys
import time


from specdec.runtime import torch_thread
from specdec.runtime.sequence import SequenceCache
from specdec.runtime.models import load_model
from specdec.weights import vocab_rank
from specdec.weights.pairs import PAIRS
from specdec_tools.bench.data import DEFAULT_QUESTIONS, load_questions
from specdec_tools.bench.systems import chat_ids


@torch_thread.runs_on_it
def greedy(loaded, prompt: list[int], tokens: int, eos: set[int]) -> list[int]:
    """The served forward's greedy continuation (the lean forward over the static cache)."""
    seq = SequenceCache(loaded, prompt)
    seq.prefill()
    out: list[int] = []
    logits = seq.forward([], keep_last=1)
    for _ in range(tokens):
        token = int(logits[-1, : loaded.vocab_size].argmax())
        if token in eos:
            break
        out.append(token)
        logits = seq.forward([token], keep_last=1)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default="qwen-coder", choices=sorted(PAIRS))
    parser.add_argument("--questions", type=pathlib.Path, default=DEFAULT_QUESTIONS)
    parser.add_argument("--every", type=int, default=2, help="rank on every k-th question (the rest stay unseen)")
    parser.add_argument("--tokens", type=int, default=96, help="answer tokens per question")
    parser.add_argument("--max-prompt-tokens", type=int, default=1200)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out-questions", type=pathlib.Path, default=pathlib.Path("vocab_rank_questions.json"))
    args = parser.parse_args()
    torch_thread.set_threads(args.threads)
    pair = PAIRS[args.pair]
    target = torch_thread.run(load_model, pair.target, dtype=pair.target_dtype, quantize=pair.target_quantize)
    questions = load_questions(args.questions, None, None)[:: args.every]
    outputs, prompts = collections.Counter(), collections.Counter()
    read, started = [], time.perf_counter()
    for i, question in enumerate(questions):
        prompt = chat_ids(target.tokenizer, question.prompt)
        if len(prompt) > args.max_prompt_tokens:
            continue
        answer = greedy(target, prompt, args.tokens, set(target.eos_token_ids))
        outputs.update(answer)
        prompts.update(prompt)
        read.append(question.question_id)
        print(f"vocab_rank: {i + 1}/{len(questions)} {question.category}: {len(answer)} tokens, "
              f"{len(outputs)} distinct ids written [{time.perf_counter() - started:.0f} s]", file=sys.stderr,
              flush=True)
    ranked = vocab_rank.rank(dict(outputs), dict(prompts))
    path = vocab_rank.save(target.fingerprint, ranked)
    args.out_questions.write_text(json.dumps(read))
    total = sum(outputs.values())
    for n in (1024, 4096, 8192, 16384, 32768):
        covered = sum(outputs[i] for i in ranked[:n])
        print(f"top {n:>6} ids hold {covered / total:.4f} of the {total} answer tokens ranked on (in-sample)")
    print(f"wrote {path} ({len(ranked)} ranked ids) and {args.out_questions}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
