#!/usr/bin/env python
"""Acceptance against bytes for truncated draft distributions (`--draft-top-k`,
`--draft-top-p`): which support the drafter should send when sampling.

The drafter may propose from any distribution the verifier knows exactly, so
cutting its distribution q to a top-k / top-p support is lossless; what it
changes is the acceptance rate, which for one position is exactly
sum_x min(p(x), q'(x)) (Leviathan et al.), p the target's distribution. This
measures that expectation (no sampling noise) at every position of draft-model
continuations of Spec-Bench prompts, with both models of the pair as the
services load them, for the dense proposal and each truncation, and the bytes
each sends per drafted token (the DraftProbs message, serialized).
Prints a table and writes JSON.

  python scripts/draft_truncation.py --pair qwen-coder --per-task 1 --tokens 32
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import torch

from drafter.draft_session import DraftSession
from specdec.runtime import torch_thread
from specdec.runtime.kv_cache import SequenceCache, drive
from specdec.runtime.models import load_model
from specdec.weights.pairs import PAIRS
from specdec.spec.proposer import Commit
from specdec.spec.sampling import SamplingConfig
from specdec.spec.transform import scores_to_probs, transform_logits
from specdec_tools.bench.data import DEFAULT_QUESTIONS, load_questions
from specdec_tools.bench.systems import chat_ids
from specdec.spec.wire import Truncation, draft_probs_to_proto
from specdec.spec.draft_probs import dense_for_wire, draft_probs_tensor, truncate_for_wire

TRUNCATIONS = {"dense": Truncation(), **{f"top-k {k}": Truncation(top_k=k) for k in (4, 8, 16, 32, 64, 128, 256)},
               **{f"top-p {p}": Truncation(top_p=p) for p in (0.9, 0.95, 0.99)},
               "top-k 256, top-p 0.99": Truncation(top_k=256, top_p=0.99)}


def teacher_forced_probs(loaded, prompt: list[int], continuation: list[int], sampling: SamplingConfig):
    """[len(continuation), vocab] the model's sampling distribution before each continuation token."""
    seq = SequenceCache(loaded, prompt)
    seq.prefill()
    logits = drive(seq.step(continuation[:-1], keep_last=len(continuation)))
    history = prompt[:-1]  # the repetition penalty's history (off at these settings, kept for exactness)
    return scores_to_probs(transform_logits(logits, history, continuation, sampling, loaded.vocab_size))


@torch_thread.runs_on_it
def measure(draft, target, prompt: list[int], tokens: int, sampling: SamplingConfig, seed: int) -> list[dict]:
    session = DraftSession(draft, prompt)
    session.generator = torch.Generator().manual_seed(seed)
    continuation = []
    for _ in range(tokens):  # the draft's own sampled continuation: the text a drafter drafts on
        token = session.propose(1, sampling).token_ids[0]
        session.commit(Commit(1, ()))
        continuation.append(token)
    target_probs = teacher_forced_probs(target, prompt, continuation, sampling)   # [n, V]
    draft_probs = teacher_forced_probs(draft, prompt, continuation, sampling)     # [n, V]
    rows = []
    for i in range(len(continuation)):
        row = {}
        for name, truncation in TRUNCATIONS.items():
            entry = dense_for_wire(draft_probs[i]) if truncation.off else truncate_for_wire(draft_probs[i],
                                                                                            truncation)
            # Any support token would do as the drafted one: the rebuild is what is measured.
            sent = draft_probs_tensor([entry], [entry.token_ids[0] if entry.token_ids else
                                                int(draft_probs[i].argmax())], target.vocab_size)[0]
            row[name] = dict(acceptance=float(torch.minimum(target_probs[i], sent).sum()),
                             bytes=draft_probs_to_proto([entry])[0].ByteSize(),
                             support=len(entry.token_ids) or target.vocab_size)
        rows.append(row)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default="qwen-coder", choices=sorted(PAIRS))
    parser.add_argument("--questions", type=pathlib.Path, default=DEFAULT_QUESTIONS)
    parser.add_argument("--per-task", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=32, help="continuation tokens per prompt")
    parser.add_argument("--max-prompt-tokens", type=int, default=1200, help="skip longer prompts (prefill time)")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("draft_truncation.json"))
    args = parser.parse_args()
    torch_thread.set_threads(args.threads)
    pair = PAIRS[args.pair]
    say = lambda message: print(f"draft_truncation: {message}", file=sys.stderr, flush=True)  # noqa: E731
    draft = torch_thread.run(load_model, pair.draft, dtype=pair.draft_dtype, quantize=pair.draft_quantize,
                             head_vocab=pair.draft_head_vocab)
    target = torch_thread.run(load_model, pair.target, dtype=pair.target_dtype, quantize=pair.target_quantize)
    sampling = SamplingConfig(temperature=args.temperature)
    positions: list[dict] = []
    started = time.perf_counter()
    for i, question in enumerate(load_questions(args.questions, None, None, args.per_task)):
        prompt = chat_ids(target.tokenizer, question.prompt)
        if len(prompt) > args.max_prompt_tokens:
            say(f"skipping {question.category} q{question.question_id}: {len(prompt)} prompt tokens")
            continue
        rows = measure(draft, target, prompt, args.tokens, sampling, args.seed + i)
        positions += rows
        say(f"{question.category} q{question.question_id}: {len(prompt)} prompt tokens, {len(rows)} positions, "
            f"dense acceptance {statistics.mean(r['dense']['acceptance'] for r in rows):.3f} "
            f"[{time.perf_counter() - started:.0f} s]")
    dense = statistics.mean(r["dense"]["acceptance"] for r in positions)
    summary = []
    for name in TRUNCATIONS:
        acceptance = statistics.mean(r[name]["acceptance"] for r in positions)
        summary.append(dict(truncation=name, acceptance=round(acceptance, 4),
                            points_below_dense=round(100 * (dense - acceptance), 2),
                            bytes_per_token=round(statistics.mean(r[name]["bytes"] for r in positions), 1),
                            max_bytes=max(r[name]["bytes"] for r in positions),
                            mean_support=round(statistics.mean(r[name]["support"] for r in positions), 1)))
    print(f"{len(positions)} positions, {args.pair}, T={args.temperature:g}: expected acceptance "
          "sum(min(target, draft)) and bytes sent per drafted token\n")
    print("| truncation | acceptance | points below dense | bytes / token (mean, max) | support |")
    print("|---|---|---|---|---|")
    for row in summary:
        print(f"| {row['truncation']} | {row['acceptance']:.4f} | {row['points_below_dense']:.2f} | "
              f"{row['bytes_per_token']:.0f}, {row['max_bytes']} | {row['mean_support']:.0f} |")
    args.out.write_text(json.dumps(dict(pair=args.pair, temperature=args.temperature, positions=len(positions),
                                        summary=summary), indent=1))
    say(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
