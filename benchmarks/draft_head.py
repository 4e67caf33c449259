#!/usr/bin/env python
"""A draft head cut to the N most frequent ids (`--head-vocab N`, ranked by
benchmarks/vocab_rank.py) against its cost: for each N, the draft step's ms (the
INT8 draft loaded with that head, the forward the drafter runs, 1 and 4 rows
after a prefix), and on Spec-Bench dev prompts the ranking did not read, with
the target's own greedy answers teacher-forced: the expected acceptance
sum(min(target, draft)) at T=0.7 (the draft renormalized over its kept ids, as
the drafter samples and sends it) and greedy agreement (the draft's top id is
the target's). Also the same N cut by id, the ranking's baseline. Prints a
table and writes JSON.

  python benchmarks/draft_head.py --pair qwen-coder --sizes 8192,16384,32768,65536,0 --per-task 2
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys

# As the model services: OpenMP's idle workers sleep soon (specdec.runtime.torch_thread.SPIN_COUNT),
# before torch loads; else, after the target's torch ops, they spin on the cores a draft's ggml graph runs on.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

import torch  # noqa: E402

from specdec.runtime import torch_thread  # noqa: E402
from specdec.runtime.sequence import SequenceCache, drive  # noqa: E402
from specdec.runtime.models import load_model  # noqa: E402
from specdec.spec.sampling import SamplingConfig  # noqa: E402
from specdec.spec.transform import scores_to_probs, transform_logits  # noqa: E402
from specdec.weights import vocab_rank  # noqa: E402
from specdec.weights.pairs import PAIRS  # noqa: E402
from specdec_tools.bench.data import DEFAULT_QUESTIONS, load_questions  # noqa: E402
from specdec_tools.bench.systems import chat_ids  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from quant_check import forward_ms  # noqa: E402
from vocab_rank import greedy  # noqa: E402

SAMPLED = SamplingConfig(temperature=0.7)


@torch_thread.runs_on_it
def teacher_forced_logits(loaded, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    seq = SequenceCache(loaded, prompt)
    seq.prefill()
    return drive(seq.step(continuation[:-1], keep_last=len(continuation)))[:, : loaded.vocab_size]


def probs(logits: torch.Tensor, prompt: list[int], continuation: list[int], vocab: int) -> torch.Tensor:
    return scores_to_probs(transform_logits(logits, prompt[:-1], continuation, SAMPLED, vocab))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default="qwen-coder", choices=sorted(PAIRS))
    parser.add_argument("--questions", type=pathlib.Path, default=DEFAULT_QUESTIONS)
    parser.add_argument("--sizes", default="8192,16384,32768,65536,0", help="head sizes (0: the whole vocabulary)")
    parser.add_argument("--draft-quantize", default=None, help="the draft's quantization (default: the pair's)")
    parser.add_argument("--per-task", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--skip-ranked", type=pathlib.Path, default=pathlib.Path("vocab_rank_questions.json"),
                        help="questions the ranking read (vocab_rank.py's list): left out here")
    parser.add_argument("--max-prompt-tokens", type=int, default=1200)
    parser.add_argument("--rounds", type=int, default=5, help="rounds of step timings, every head in each")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("draft_head.json"))
    args = parser.parse_args()
    torch_thread.set_threads(args.threads)
    pair = PAIRS[args.pair]
    draft_quantize = args.draft_quantize or pair.draft_quantize
    say = lambda message: print(f"draft_head: {message}", file=sys.stderr, flush=True)  # noqa: E731
    target = torch_thread.run(load_model, pair.target, dtype=pair.target_dtype, quantize=pair.target_quantize)
    draft = torch_thread.run(load_model, pair.draft, dtype=pair.draft_dtype, quantize=draft_quantize)
    ranking = vocab_rank.load(target.fingerprint)
    if ranking is None:
        say(f"no ranking for this tokenizer in {vocab_rank.DIR}: run benchmarks/vocab_rank.py first")
        return 1
    ranked_on = set(json.loads(args.skip_ranked.read_text())) if args.skip_ranked.is_file() else set()
    questions = [q for q in load_questions(args.questions, None, None, args.per_task) if q.question_id not in ranked_on]
    vocab = target.vocab_size
    special = {*target.tokenizer.all_special_ids, *target.tokenizer.added_tokens_decoder, *target.eos_token_ids}
    sizes = [int(s) for s in args.sizes.split(",")]
    cuts = {}
    for n in sizes:
        for how, rank in (("frequency", ranking), ("id", None)):
            if n and (how == "frequency" or n < vocab):
                cuts[(n, how)] = torch.tensor(vocab_rank.head_ids(vocab, n, special, rank))
    cuts[(0, "all")] = torch.arange(vocab)
    accepted = {key: [] for key in cuts}
    agreed = {key: [] for key in cuts}
    for question in questions:
        prompt = chat_ids(target.tokenizer, question.prompt)
        if len(prompt) > args.max_prompt_tokens:
            continue
        answer = greedy(target, prompt, args.tokens, set(target.eos_token_ids))
        if len(answer) < 2:
            continue
        target_logits = teacher_forced_logits(target, prompt, answer)
        draft_logits = teacher_forced_logits(draft, prompt, answer)
        target_probs = probs(target_logits, prompt, answer, vocab)
        target_top = target_logits.argmax(-1)
        for key, keep in cuts.items():
            masked = torch.full_like(draft_logits, float("-inf"))
            masked[:, keep] = draft_logits[:, keep]
            draft_probs = probs(masked, prompt, answer, vocab)
            accepted[key] += torch.minimum(target_probs, draft_probs).sum(-1).tolist()
            agreed[key] += (masked.argmax(-1) == target_top).tolist()
        say(f"{question.category} q{question.question_id}: {len(answer)} positions")
    del draft
    prefix = (chat_ids(target.tokenizer, questions[0].prompt) * 8)[:200]
    # Every head and the target timed in turn, round after round, and the median of each one's
    # rounds kept: a shared machine drifts by tens of percent over minutes, which timing one
    # after the other would read as a difference between them.
    drafts = {n: torch_thread.run(load_model, pair.draft, dtype=pair.draft_dtype, quantize=draft_quantize,
                                  head_vocab=n) for n in sizes}
    timed = {n: ([], []) for n in sizes}
    target_times = []
    for _ in range(args.rounds):
        for n, loaded in drafts.items():
            for rows, times in zip((1, 4), timed[n]):
                times.append(torch_thread.run(forward_ms, loaded, prefix, rows, 3))
        target_times.append(torch_thread.run(forward_ms, target, prefix, 1, 3))
    steps = {n: (statistics.median(one), statistics.median(four)) for n, (one, four) in timed.items()}
    for n in sizes:
        say(f"head {n or 'all'}: {steps[n][0]:.1f} ms a step, {steps[n][1]:.1f} ms for 4 rows")
    del drafts
    target_ms = statistics.median(target_times)
    rows = []
    for (n, how), keep in cuts.items():
        step = steps.get(n) if how != "id" else None
        rows.append(dict(head=n or vocab, ranked_by=how, kept=int(keep.numel()),
                         acceptance=round(statistics.mean(accepted[(n, how)]), 4),
                         greedy_agreement=round(statistics.mean(agreed[(n, how)]), 4),
                         step_ms=round(step[0], 2) if step else None, step_ms_4_rows=round(step[1], 2) if step else None,
                         step_vs_target=round(step[0] / target_ms, 3) if step else None))
    positions = len(accepted[(0, "all")])
    print(f"{args.pair}, draft in {draft_quantize}: {positions} positions of {len(questions)} dev questions "
          "the ranking did not read; "
          f"target step {target_ms:.1f} ms; acceptance = E sum(min(target, draft)) at T=0.7\n")
    print("| head ids | ranked by | acceptance | greedy agreement | draft step ms (1 row, 4 rows) | step / target step |")
    print("|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: (r["head"], r["ranked_by"])):
        step = f"{r['step_ms']:.1f}, {r['step_ms_4_rows']:.1f}" if r["step_ms"] else "-"
        ratio = f"{r['step_vs_target']:.2f}" if r["step_vs_target"] else "-"
        print(f"| {r['head']} | {r['ranked_by']} | {r['acceptance']:.4f} | {r['greedy_agreement']:.4f} | {step} | {ratio} |")
    args.out.write_text(json.dumps(dict(pair=args.pair, draft_quantize=draft_quantize, positions=positions,
                                        target_step_ms=target_ms, rows=rows),
                                   indent=1))
    say(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
