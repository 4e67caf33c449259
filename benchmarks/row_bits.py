#!/usr/bin/env python
"""How many bits of each activation row the int4 target's int8 x int8 layers need:
for rows of real decode steps and prefills (position 0 apart), the relative output
error of fbgemm's per-row kernel at 14 bits (two 7-bit passes, `fbgemm-int8-row`) and
at 8 (one pass, `fbgemm-int8-row8`) against the int8 weight's exact product, on the
gate/up and down projections; and each row's own rounding error before the GEMM (what
a kernel could read to give a row the second pass only where it needs it).

For the down projections, whose outliers 8 bits a row lose, two splits as LLM.int8()
makes them: `--split K` entries of each row kept exact (beside the 8-bit pass over the
rest), taken either as the K input channels largest on the prefill rows (fixed channels,
a kernel's static gather) or as each row's own K largest entries (a gather per call).

  python benchmarks/row_bits.py [--model qwen2.5-coder-1.5b-instruct] [--prompts 3] [--tokens 24] [--split 32]
"""
from __future__ import annotations

import argparse
import collections
import json
import pathlib

import torch

from specdec.runtime import kernels
from specdec.runtime.models import load_model
from specdec.runtime.quant import int4, int8
from specdec.runtime.sequence import SequenceCache

DEV = pathlib.Path(__file__).resolve().parent.parent.parent / "shared/data/spec_bench/questions_dev.jsonl"


def captured_inputs(loaded, prompts: int, tokens: int) -> tuple[dict, dict]:
    """Each 14-bit layer's input rows, as (decoding?, rows) per call; layers by id."""
    inputs, layers, decoding = collections.defaultdict(list), {}, [False]

    def recording(cls, kind_of):
        forward = cls.forward

        def wrapped(self, x, *args, **kwargs):
            if kind := kind_of(self):
                layers[id(self)] = (kind, self)
                inputs[id(self)].append((decoding[0], x.reshape(-1, x.shape[-1]).float().clone()))
            return forward(self, x, *args, **kwargs)
        cls.forward = wrapped
    recording(int4.Int4Linear, lambda m: "gate_up" if m.int8_activations else None)
    recording(int8.Int8WeightOnlyLinear, lambda m: "down" if m.activation_bits == 14 else None)
    loaded.lean._graph_choice = False   # decode on the torch modules, whose inputs are recorded
    questions = [json.loads(line) for line in DEV.read_text().splitlines()]
    with torch.inference_mode():
        for q in questions[:: max(1, len(questions) // prompts)][:prompts]:
            text = loaded.tokenizer.apply_chat_template([{"role": "user", "content": q["turns"][0]}],
                                                        tokenize=False, add_generation_prompt=True)
            ids = loaded.tokenizer.encode(text, add_special_tokens=False)[:200]
            seq = SequenceCache(loaded, ids[:-1])
            decoding[0] = False
            seq.prefill()
            decoding[0], last = True, ids[-1]
            for _ in range(tokens):
                last = int(seq.forward([last], keep_last=1)[-1].argmax())
    return inputs, layers


def split_errors(calls: list, weight: torch.Tensor, state, coarse, k: int) -> dict[str, list[float]]:
    """Decode rows' output error when k entries of each row are kept exact and the rest take the
    8-bit pass: the k channels of largest |x| times weight column norm over the prefill rows, or
    each row's k largest |x|."""
    prefill = torch.cat([x for decode, x in calls if not decode] or [torch.zeros(1, weight.shape[1])])
    channels = (prefill.abs().amax(0) * weight.norm(dim=0)).argsort(descending=True)[:k]
    found = collections.defaultdict(list)
    for decode, x in calls:
        if not decode:
            continue
        exact = x.double() @ weight.double().t()
        for name, kept in ((f"8 bits, {k} fixed channels exact", channels.expand(len(x), k)),
                           (f"8 bits, each row's {k} largest exact", x.abs().topk(k, dim=1).indices)):
            rest = x.scatter(1, kept, 0.0)
            y = coarse.run(state, rest).double() + (x - rest).double() @ weight.double().t()
            found[name] += ((y - exact).norm(dim=1) / exact.norm(dim=1)).tolist()
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--split", type=int, default=32, help="entries of a down projection's row kept exact")
    args = parser.parse_args()
    loaded = load_model(args.model, dtype="bf16", quantize="int4")
    inputs, layers = captured_inputs(loaded, args.prompts, args.tokens)
    backends = {b.name: b for b in kernels.BACKENDS}
    fine, coarse = backends["fbgemm-int8-row"], backends["fbgemm-int8-row8"]
    levels, step, zero = kernels._fbgemm_grid()
    found = collections.defaultdict(list)
    for key, calls in inputs.items():
        kind, layer = layers[key]
        codes, scales = (int8.per_row_int8(layer.dense_weight(torch.float32)) if kind == "gate_up"
                         else (layer.qweight, layer.scales.float()))
        weight, state = codes.float() * scales[:, None], fine.prepare(codes, scales)
        for decode, x in calls:
            exact = x.double() @ weight.double().t()
            scaled, width, _ = kernels._onto_unit(x)
            rounded = torch.round(scaled / step).clamp_(-zero, levels - zero).mul_(step)
            own = ((scaled - rounded) * width / 2).norm(dim=1) / x.norm(dim=1).clamp(min=1e-30)
            rows = ["decode"] * len(x) if decode else ["position 0"] + ["prefill"] * (len(x) - 1)
            for name, y in (("14 bits", fine.run(state, x)), ("8 bits", coarse.run(state, x))):
                errors = ((y.double() - exact).norm(dim=1) / exact.norm(dim=1)).tolist()
                for row, error in zip(rows, errors):
                    found[(kind, row, name)].append(error)
            for row, error in zip(rows, own.tolist()):
                found[(kind, row, "the row's own 8-bit rounding")].append(error)
        if kind == "down" and args.split:
            for name, errors in split_errors(calls, weight, state, coarse, args.split).items():
                found[(kind, "decode", name)] += errors
    print("| layers | rows | output error at | n | median | p90 | p99 | max |")
    print("|---|---|---|---|---|---|---|---|")
    for (kind, row, name), errors in sorted(found.items()):
        errors.sort()
        at = lambda q: errors[min(len(errors) - 1, int(q * len(errors)))]  # noqa: E731
        print(f"| {kind} | {row} | {name} | {len(errors)} | {at(.5):.2%} | {at(.9):.2%} | {at(.99):.2%} | "
              f"{errors[-1]:.2%} |")


if __name__ == "__main__":
    main()
