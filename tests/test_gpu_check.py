"""scripts/gpu_check.sh on this machine: without CUDA it says so in one line and
runs every section on the CPU on small shapes, so the script a GPU session runs
is known to work, and its table (markdown and JSON) holds what each section
measured."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from specdec_tools.gpu import shapes
from specdec_tools.gpu.steps import ROWS

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.integration
def test_the_gpu_check_runs_every_section_and_writes_one_table(tmp_path):
    # No payload: the small shapes over the tiny tokenizer, as on a fresh clone (CI).
    result = subprocess.run([str(ROOT / "scripts" / "gpu_check.sh"), "--quick", "--payload", str(tmp_path / "none"),
                             "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=900,
                            env={**os.environ, "PYTHON": sys.executable})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    if not torch.cuda.is_available():
        assert result.stdout.splitlines()[0].startswith("gpu_check: no CUDA device here")
    table = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    sections = {k: v for k, v in table.items() if k != "meta"}
    assert {name: s["status"] for name, s in sections.items()} == dict.fromkeys(
        ["environment", "tiny pair greedy", "step costs", "argmax, k rows against 1", "static step", "services",
         "compiled step", "transformers generate", "chi-square"], "ok")
    steps = sections["step costs"]["value"]
    assert [s["label"] for s in steps] == ["draft bf16", "draft INT8", "target 1.5B bf16", "target 7B bf16"]
    for step in steps:
        assert [int(n) for n in step["rows_ms"]] == list(ROWS) and min(step["rows_ms"].values()) > 0, step
        assert step["launches"] > 0 and step["prefill_ms_per_token"] > 0
    # Each model has the vocabulary padding of its family: the 7B's is wider, over one tokenizer.
    configs = {name: json.loads((pathlib.Path(m) / "config.json").read_text())
               for name, m in ((s["label"], s["model"]) for s in steps)}
    assert configs["target 7B bf16"]["vocab_size"] > configs["target 1.5B bf16"]["vocab_size"]
    static = sections["static step"]["value"]["models"]
    assert [s["label"] for s in static] == ["draft 0.5B bf16", "draft 0.5B INT8", "target 1.5B bf16", "target 7B bf16"]
    compiled = sections["compiled step"]["value"]
    # On the CPU the INT8 draft is fbgemm's, which does not compile: said so, not timed.
    assert [s["label"] for s in compiled["models"]] == ["draft 0.5B bf16, compiled", "target 7B bf16, compiled"]
    assert compiled["backend"] == "inductor" and "INT8" in compiled["skipped"][0]
    for step, rows in [*((s, [1, 2, 4, 8, 16]) for s in static), *((s, [1, 8]) for s in compiled["models"])]:
        assert [int(n) for n in step["rows_ms"]] == rows and min(step["rows_ms"].values()) > 0, step
        assert step["graphs"] == torch.cuda.is_available()
        assert min(step["chain_ms"][way] for way in ("read_each", "read_behind", "chained", "sampled_read_each",
                                                     "sampled_chained")) > 0, step
        assert [int(n) for n in step["long_rows_ms"]] == [1, 8] and step["long_ratio_8"] > 0, step
        greedy = step["greedy"]   # the same tokens, or parted by a bf16 tie
        assert greedy["agreed"] == greedy["of"] == 16 or greedy["first_difference_bf16_steps"] <= 2.0, step
    pairs = sections["services"]["value"]
    assert [p["pair"] for p in pairs] == ["0.5B -> 7B", "0.5B -> 1.5B"]
    for pair in pairs:
        assert pair["draft_curve"] and len(pair["verify_curve"]) >= 5 and not pair["skipped"]
        # Read again after the runs: the live curves, the same rows (their values are the machine's)
        assert len(pair["verify_curve_after"]) == len(pair["verify_curve"]) and pair["draft_curve_after"], pair
        runs = {r["system"]: r for r in pair["runs"]}
        assert list(runs) == ["target-only", "γ=1", "γ=2", "γ=4", "auto"]
        assert all(r["synthetic"] == pytest.approx(0.8) and r["ms_per_token"] > 0 for r in runs.values())
        # A fixed γ drafts min(γ, the tokens left less one) a round, so the last rounds of a 12-token request
        # draft fewer, as many as the synthetic draws leave: γ=4 averages 2.2 a round at the fewest (two full
        # rounds and three short ones), 3.2 typically. Above what γ=2 can draft, whatever the draws.
        assert runs["γ=2"]["drafted_per_round"] <= 2.0 < runs["γ=4"]["drafted_per_round"] <= 4.0
        assert 1.0 < runs["γ=4"]["mean_accepted_length"] <= 5.0
        assert runs["γ=1"]["outside_ms_per_round"] is not None
        assert all(r["rpc_ms_per_round"] is not None for r in runs.values()), runs   # every system's calls
    generate = sections["transformers generate"]["value"]["models"]
    assert [g["label"] for g in generate] == ["target 7B bf16", "target 1.5B bf16"]
    assert all(g["decode_ms_per_token"] > 0 and g["compiled"] == torch.cuda.is_available() for g in generate)
    assert sections["chi-square"]["value"]["runs"] == 200   # --quick's; 2,000 in the full check
    markdown = (tmp_path / "out" / "gpu_check.md").read_text()
    assert "| model | B params |" in markdown and "| static step | GB read a step |" in markdown and "bound.py on the services' curves" in markdown
    assert "| services target-only ms / token |" in markdown
    assert "The services' curves after the runs" in markdown


def test_the_seven_b_config_is_the_families_with_the_seven_b_shape():
    target = {"hidden_size": 1536, "num_hidden_layers": 28, "layer_types": ["full_attention"] * 28,
              "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "tie_word_embeddings": True,
              "vocab_size": 151936, "num_attention_heads": 12, "num_key_value_heads": 2, "intermediate_size": 8960}
    seven = shapes.seven_b_config(target)
    assert (seven["hidden_size"], seven["num_hidden_layers"], seven["num_attention_heads"],
            seven["num_key_value_heads"], seven["intermediate_size"], seven["vocab_size"]) == \
        (3584, 28, 28, 4, 18944, 152064)
    assert seven["tie_word_embeddings"] is False and seven["rope_parameters"]["rope_theta"] == 1e6
    assert 7.5 < shapes.parameters(seven) < 7.7     # Qwen2.5-7B: 7.61B
    assert target["hidden_size"] == 1536            # the 1.5B's config is left as it was
    small = shapes.small(seven, tokenizer_vocab=512, padding=136)
    assert small["num_hidden_layers"] == len(small["layer_types"]) == 2 and small["vocab_size"] == 648
    assert small["num_attention_heads"] % small["num_key_value_heads"] == 0


def test_the_services_draft_in_int8_only_where_it_was_faster_on_the_forward_they_run():
    from specdec_tools.gpu.check import draft_path
    lean_rows = [{"label": "draft INT8", "rows_ms": {1: 0.9}}, {"label": "draft bf16", "rows_ms": {1: 1.2}}]
    static = {"models": [{"label": "draft 0.5B bf16", "rows_ms": {"1": 0.6}},      # JSON keys: strings
                         {"label": "draft 0.5B INT8", "rows_ms": {"1": 0.8}}]}     # eager cast: slower
    assert draft_path(lean_rows, static, "lean")[0] == "int8"
    quantize, why = draft_path(lean_rows, static, "paged")
    assert quantize == "none" and "0.60" in why and "0.80" in why, why
    static["models"][1]["rows_ms"] = {"1": 0.5}
    assert draft_path(lean_rows, static, "paged")[0] == "int8"
    static["models"][1] = {"label": "draft 0.5B INT8", "error": "OOM"}
    assert draft_path(lean_rows, static, "paged")[0] == "none"
    assert draft_path(None, None, "lean")[0] == "none"


def test_the_services_run_the_static_step_only_where_it_captured_its_graphs_and_kept_the_tokens():
    from specdec_tools.gpu.check import services_forward
    good = {"graphs": True, "greedy": {"agreed": 16, "of": 16}}
    labels = ("draft 0.5B bf16", "draft 0.5B INT8", "target 1.5B bf16", "target 7B bf16")
    static = {"models": [{"label": label, **good} for label in labels]}
    assert services_forward(static)[0] == "paged"
    tie = {"graphs": True, "greedy": {"agreed": 9, "of": 16, "first_difference_bf16_steps": 1.0}}
    assert services_forward({"models": [{**m, **tie} for m in static["models"]]})[0] == "paged"
    for broken, said in (({"graphs": False}, "without graphs"), ({"error": "OOM"}, "failed (OOM)"),
                         ({"greedy": {"agreed": 3, "of": 16, "first_difference_bf16_steps": 40.0}}, "greedy")):
        models = [{**m, **broken} if m["label"] == "target 7B bf16" else m for m in static["models"]]
        forward, why = services_forward({"models": models})
        assert forward == "lean" and "target 7B bf16" in why and said in why, why
    assert services_forward(None)[0] == "lean"      # the section failed whole: the lean forward
