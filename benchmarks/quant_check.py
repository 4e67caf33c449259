#!/usr/bin/env python
"""Served weights against the fp32 de-quantized GGUF, side by side in one run:
forward time for 1, 4 and 5 rows (--rows) after a 200-token prefix (the forward the
services run), and teacher-forced quality (top-1 agreement and mean KL against
fp32) on Spec-Bench dev prompts, each followed by the fp32 model's own greedy
continuation. Prints a table and writes JSON.

  python benchmarks/quant_check.py --model qwen2.5-coder-1.5b-instruct --configs bf16:none,bf16:int4
  python benchmarks/quant_check.py --model qwen2.5-coder-0.5b-instruct --configs fp32:int8,bf16:int4
"""
from __future__ import annotations

import argparse
import json
import logging
import pathlib
import statistics
import time

import torch

from specdec.runtime.sequence import SequenceCache
from specdec.runtime import torch_thread
from specdec.runtime.models import load_model

DEV = pathlib.Path(__file__).resolve().parent.parent.parent / "shared/data/spec_bench/questions_dev.jsonl"


def forward_ms(loaded, prefix: list[int], rows: int, repeats: int = 6) -> float:
    times = []
    for _ in range(repeats):
        seq = SequenceCache(loaded, prefix)
        seq.prefill()
        seq.forward([], keep_last=1)
        started = time.perf_counter()
        seq.forward(prefix[1:rows + 1], keep_last=rows)
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def logits(loaded, ids: list[int], start: int) -> torch.Tensor:
    """Logits predicting ids[start:] and one more, through the served forward: [len - start + 1, vocab]."""
    seq = SequenceCache(loaded, ids[:start - 1])
    return seq.forward(ids[start - 1:], keep_last=len(ids) - start + 1)


def teacher_forced(reference, prompts: int, new: int) -> list[tuple[int, list[int]]]:
    """`prompts` dev prompts spread over the file, each followed by the reference's own greedy
    continuation of `new` tokens: [(prompt length, ids)], to teacher-force other weights on."""
    tok = reference.tokenizer
    questions = [json.loads(line) for line in DEV.read_text().splitlines()]
    texts = []
    for q in (questions[i * len(questions) // prompts] for i in range(prompts)):
        text = tok.apply_chat_template([{"role": "user", "content": q["turns"][0]}], tokenize=False,
                                       add_generation_prompt=True)
        ids = tok.encode(text, add_special_tokens=False)
        out = reference.model.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False)
        texts.append((len(ids), out[0].tolist()))
    return texts


def agreement(loaded, texts, ref_logits) -> tuple[float, float]:
    """(top-1 agreement, mean KL) of `loaded` against the reference's logits on `texts`."""
    agree, kl, n = 0, 0.0, 0
    for (start, ids), ref in zip(texts, ref_logits):
        mine = logits(loaded, ids, start).float()
        agree += int((mine.argmax(-1) == ref.argmax(-1)).sum())
        kl += float(torch.nn.functional.kl_div(mine.log_softmax(-1), ref.log_softmax(-1), log_target=True,
                                               reduction="sum"))
        n += mine.shape[0]
    return agree / n, kl / n


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--configs", default="bf16:none,bf16:int4",
                        help="dtype:quantize pairs to compare with fp32 (comma-separated)")
    parser.add_argument("--rows", default="1,4,5", help="forward rows to time (comma-separated)")
    parser.add_argument("--out", default="quant_check.json")
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    torch_thread.set_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the int4 conversion's report
    reference = load_model(args.model, dtype="fp32")
    texts = teacher_forced(reference, args.prompts, args.new)
    ref_logits = [logits(reference, ids, start) for start, ids in texts]
    prefix = (texts[0][1] * 4)[:200]
    results = {}
    configs = [("fp32", "none"), *(tuple(c.split(":")) for c in args.configs.split(","))]
    for dtype, quantize in configs:
        name = dtype if quantize == "none" else f"{dtype}+{quantize}"
        loaded = reference if name == "fp32" else load_model(args.model, dtype=dtype, quantize=quantize)
        top1, kl = agreement(loaded, texts, ref_logits)
        results[name] = {"top1_agreement_vs_fp32": top1, "mean_kl_vs_fp32": kl,
                         **{f"forward_ms_{r}_rows": forward_ms(loaded, prefix, r) for r in rows}}
        if loaded is not reference:
            del loaded
    print(f"{args.model}, {args.threads} threads, 200-token prefix; quality teacher-forced on {args.prompts} dev "
          f"prompts x {args.new} tokens")
    print(f"{'weights':10s} " + " ".join(f"{f'{r} rows':>9s}" for r in rows) + f" {'top-1 vs fp32':>14s} {'KL vs fp32':>11s}")
    for name, r in results.items():
        print(f"{name:10s} " + " ".join(f"{r[f'forward_ms_{n}_rows']:6.1f} ms" for n in rows)
              + f" {r['top1_agreement_vs_fp32']:14.3f} {r['mean_kl_vs_fp32']:11.4f}")
    pathlib.Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(torch_thread.run(main))  # all of it on the process's torch thread
