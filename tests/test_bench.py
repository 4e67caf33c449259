"""`specdec bench --quick` on the tiny pair: the real services as subprocesses,
the in-process baselines, and every output file."""
from __future__ import annotations

import json

from specdec import bench

QUESTIONS = [
    {"question_id": 1, "category": "coding", "turns": ["Write a function that adds two numbers.", "Now test it."]},
    {"question_id": 2, "category": "coding", "turns": ["def fibonacci(n):", "again"]},
    {"question_id": 3, "category": "qa", "turns": ["What is the capital of France?", "Why?"]},
    {"question_id": 4, "category": "writing", "turns": ["Once upon a time there was a small model.", "More."]},
]


def test_bench_quick_on_the_tiny_pair(tmp_path, capsys):
    questions = tmp_path / "questions.jsonl"
    questions.write_text("\n".join(json.dumps(q) for q in QUESTIONS))
    out = tmp_path / "out"
    assert bench.main(["--pair", "tiny", "--quick", "--questions", str(questions), "--categories", "coding,qa",
                       "--out", str(out)]) == 0

    report = json.loads((out / "bench.json").read_text())
    systems = ["spec-g2", "spec-g4", "spec-g6", "spec-auto", "target-only", "hf-generate", "hf-assisted"]
    assert report["meta"]["systems"] == systems
    runs = report["runs"]
    # --quick: one question per category (the second coding question is left out), both temperatures.
    assert sorted({r["question_id"] for r in runs}) == ["1", "3"]
    assert len(runs) == 2 * 2 * len(systems)
    assert all(0 < r["new_tokens"] <= 32 and r["seconds"] > 0 for r in runs)

    rows = {(r["category"], r["temperature"], r["system"]): r for r in report["summary"]}
    for system in ("spec-g2", "spec-g4", "spec-g6", "spec-auto"):
        greedy = rows[("all", 0.0, system)]
        assert greedy["greedy_identical"] == "2/2"          # lossless through the real services
        assert 0 < greedy["acceptance_rate"] <= 1
        assert 1 <= greedy["mean_accepted_length"] <= 9
        shares = sum(greedy[f"{k}_share"] for k in ("prefill", "draft", "verify", "overhead"))
        assert abs(shares - 1) < 0.01
        assert greedy["speedup_vs_target_only"] > 0 and greedy["speedup_vs_hf_assisted"] > 0
    assert rows[("all", 0.0, "target-only")]["speedup_vs_target_only"] == 1.0
    assert set(report["meta"]["best_gamma"]) == {"coding", "qa", "all"}
    assert "(auto " in report["meta"]["best_gamma"]["all"]["T=0"]

    table = (out / "bench.md").read_text()
    for heading in ("## coding, T=0", "## qa, T=0.7", "## all, T=0", "## best fixed gamma",
                    "prefill / draft / verify / overhead"):
        assert heading in table
    assert table in capsys.readouterr().out
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
