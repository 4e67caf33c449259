"""The GPU check's payload (.gpu/), made here, where the pair is pulled:

  tokenizer/                   the pair's shared tokenizer files
  models/NAME/config.json      the pair's configs, as converted from their GGUFs, and
  models/NAME/generation_config.json   a 7B-class target's, of the same family (shapes.SEVEN_B)
  questions_dev.jsonl          the Spec-Bench dev questions (the check's prompts)
  acceptance.json              the acceptance the CPU bench measured for the real pair

scripts/gpu_payload.sh runs this after fetching the wheels (.whl/).

  python -m specdec_tools.gpu.payload --out .gpu [--acceptance-from bench_out/bench.json]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import shutil

from specdec.weights import registry
from specdec_tools.bench.data import DEFAULT_QUESTIONS
from specdec_tools.gpu import shapes

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".json.index")
# The real pair's model acceptance where no bench JSON is given: spec-auto on the
# Spec-Bench dev half, 13 prompts, 64 tokens (docs/benchmarks.md, the run of 589389e,
# the last in which the draft model drafted on most prompts).
DOCUMENTED = {"greedy": 0.833, "sampled": 0.788,
              "source": "docs/benchmarks.md, run of 589389e (2026-12-03): spec-auto's model acceptance, "
                        "Spec-Bench dev, 13 prompts, T=0 and T=0.7"}


def acceptance_from(bench_json: pathlib.Path) -> dict:
    """The model acceptance of a `specdec bench` run's spec-auto over all prompts, per temperature."""
    rows = [r for r in json.loads(bench_json.read_text())["summary"]
            if r["category"] == "all" and r["system"] == "spec-auto"]
    found = {("greedy" if r["temperature"] == 0 else "sampled"): r.get("model_acceptance", r.get("acceptance_rate"))
             for r in rows}
    if not all(found.get(k) for k in ("greedy", "sampled")):
        raise SystemExit(f"{bench_json}: no spec-auto model acceptance at both temperatures over all prompts")
    return {**found, "source": f"{bench_json}: spec-auto's model acceptance over all prompts"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path(".gpu"))
    parser.add_argument("--acceptance-from", type=pathlib.Path, metavar="BENCH_JSON",
                        help="a `specdec bench` run's bench.json (default: the figures of docs/benchmarks.md)")
    parser.add_argument("--questions", type=pathlib.Path, default=DEFAULT_QUESTIONS)
    args = parser.parse_args(argv)
    out = args.out
    shutil.rmtree(out, ignore_errors=True)
    hf = {name: registry.pull(name) for name in (shapes.DRAFT, shapes.TARGET)}
    tokenizer = out / "tokenizer"
    tokenizer.mkdir(parents=True)
    for file in hf[shapes.TARGET].iterdir():
        if file.name not in ("config.json", "generation_config.json") and not file.name.endswith(WEIGHT_SUFFIXES):
            shutil.copy(file, tokenizer / file.name)
    configs = {name: json.loads((path / "config.json").read_text()) for name, path in hf.items()}
    configs[shapes.TARGET_7B] = shapes.seven_b_config(configs[shapes.TARGET])
    for name, config in configs.items():
        folder = out / "models" / name
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps(config, indent=2))
        shutil.copy(hf.get(name, hf[shapes.TARGET]) / "generation_config.json", folder / "generation_config.json")
    shutil.copy(args.questions, out / "questions_dev.jsonl")
    acceptance = acceptance_from(args.acceptance_from) if args.acceptance_from else DOCUMENTED
    (out / "acceptance.json").write_text(json.dumps(acceptance, indent=2))
    for name, config in configs.items():
        print(f"gpu_payload: {name}: {shapes.parameters(config):.2f}B parameters, vocabulary {config['vocab_size']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
