"""The grammar engines side by side, on the target's tokenizer: compile time per
schema and mask time per token over a valid output, for each JSON schema of the
development half of BFCL (each function's `parameters`). What chose llguidance
(docs/structured-outputs.md).

    python benchmarks/grammar_engines.py [--model qwen2.5-coder-1.5b-instruct] [--limit 60]

llguidance is the project's own (a dependency); xgrammar and outlines-core are
measured where they are installed (`pip install xgrammar outlines-core`), and
skipped with a line saying so where not. The output walked is the ground truth's
first accepted arguments, written as the JSON the grammar allows (`, ` and `: `).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Callable

from specdec.runtime.models import load_model
from specdec.spec.grammar import JSON_STYLE, Constraint, GrammarCompiler
from specdec_tools.bench.structured import BFCL, json_schema


def cases(limit: int) -> list[tuple[str, str, str]]:
    """(id, schema text, a valid output) per simple BFCL entry."""
    out = []
    for name in ("simple_python.jsonl", "live_simple.jsonl", "multiple.jsonl"):
        for line in (BFCL / name).read_text().splitlines():
            entry = json.loads(line)
            truth = entry.get("ground_truth") or []
            if not truth:
                continue
            (function_name, arguments), = truth[0].items()
            function = next(f for f in entry["function"] if f["name"] == function_name)
            schema = json_schema(function["parameters"])
            value = {k: v[0] for k, v in arguments.items() if v and v[0] != ""}
            out.append((entry["id"], json.dumps(schema), json.dumps(value, separators=(", ", ": "))))
    return out[:limit]


def timed(fn: Callable) -> tuple[object, float]:
    started = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - started


def run_llguidance(tokenizer, eos, schemas, outputs) -> tuple[list[float], list[float]]:
    compiler = GrammarCompiler(tokenizer, eos)
    compiler.tokenizer   # built once, outside the timings (as a service does)
    compile_s, mask_s = [], []
    for schema, ids in zip(schemas, outputs):
        compiled, seconds = timed(lambda: compiler.compile(Constraint("json_schema", schema)))
        compile_s.append(seconds)
        cursor = compiler.cursor(compiled.grammar, 0)
        for token in ids:
            _, seconds = timed(cursor.mask)
            mask_s.append(seconds)
            cursor.matcher.consume_token(token)
    return compile_s, mask_s


def run_xgrammar(tokenizer, vocab_size, schemas, outputs) -> tuple[list[float], list[float]]:
    import xgrammar as xgr
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    compile_s, mask_s = [], []
    for schema, ids in zip(schemas, outputs):
        compiled, seconds = timed(lambda: compiler.compile_json_schema(
            schema, any_whitespace=False, separators=(JSON_STYLE["item_separator"], JSON_STYLE["key_separator"])))
        compile_s.append(seconds)
        matcher = xgr.GrammarMatcher(compiled)
        for token in ids:
            _, seconds = timed(lambda: matcher.fill_next_token_bitmask(bitmask))
            mask_s.append(seconds)
            matcher.accept_token(token)
    return compile_s, mask_s


def run_outlines(tokenizer, eos, schemas, outputs, budget_s: float) -> tuple[list[float], list[float]]:
    import outlines_core
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    decode = {v: k for k, v in bytes_to_unicode().items()}
    vocab: dict[bytes, list[int]] = {}
    for token, index in tokenizer.get_vocab().items():
        if index in eos:
            continue
        raw = bytes(decode[c] for c in token) if all(c in decode for c in token) else token.encode()
        vocab.setdefault(raw, []).append(index)
    vocabulary = outlines_core.Vocabulary(eos[0], vocab)
    compile_s, mask_s = [], []
    started = time.perf_counter()
    for schema, ids in zip(schemas, outputs):
        if time.perf_counter() - started > budget_s:
            print(f"outlines-core: stopped after {len(compile_s)} schemas ({budget_s:.0f} s budget)", file=sys.stderr)
            break
        regex = outlines_core.json_schema.build_regex_from_schema(
            schema, whitespace_pattern=r"[ ]?")
        index, seconds = timed(lambda: outlines_core.Index(regex, vocabulary))
        compile_s.append(seconds)
        guide = outlines_core.Guide(index)
        for token in ids:
            _, seconds = timed(guide.get_tokens)
            mask_s.append(seconds)
            try:
                guide.advance(token)
            except ValueError:
                break
    return compile_s, mask_s


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--limit", type=int, default=60)
    p.add_argument("--outlines-budget-s", type=float, default=120.0)
    p.add_argument("--json", help="write the figures here too")
    args = p.parse_args()
    loaded = load_model(args.model)
    tokenizer, eos = loaded.tokenizer, list(loaded.eos_token_ids)
    found = cases(args.limit)
    schemas = [schema for _, schema, _ in found]
    outputs = [tokenizer.encode(text, add_special_tokens=False) + [eos[0]] for _, _, text in found]
    engines = {"llguidance": lambda: run_llguidance(tokenizer, eos, schemas, outputs),
               "xgrammar": lambda: run_xgrammar(tokenizer, loaded.vocab_size, schemas, outputs),
               "outlines-core": lambda: run_outlines(tokenizer, eos, schemas, outputs, args.outlines_budget_s)}
    rows = {}
    for name, run in engines.items():
        try:
            compile_s, mask_s = run()
        except ImportError as exc:
            print(f"{name}: not installed, skipped ({exc})", file=sys.stderr)
            continue
        rows[name] = dict(schemas=len(compile_s), tokens=len(mask_s),
                          compile_ms_median=statistics.median(compile_s) * 1e3,
                          compile_ms_max=max(compile_s) * 1e3,
                          mask_us_median=statistics.median(mask_s) * 1e6,
                          mask_us_p99=sorted(mask_s)[int(len(mask_s) * 0.99)] * 1e6)
    print(f"{len(found)} BFCL schemas, {args.model}'s tokenizer ({loaded.vocab_size:,} ids)\n")
    print("| engine | schemas | tokens | compile ms (median) | compile ms (max) | mask µs (median) | mask µs (p99) |")
    print("|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['schemas']} | {r['tokens']} | {r['compile_ms_median']:.2f} | {r['compile_ms_max']:.1f} "
              f"| {r['mask_us_median']:.0f} | {r['mask_us_p99']:.0f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
