"""`specdec bench --quick` on the tiny pair: the real services as subprocesses,
the in-process baselines, and every output file."""
from __future__ import annotations

import pytest

import json

from specdec_tools import bench

QUESTIONS = [
    {"question_id": 1, "category": "coding", "turns": ["Write a function that adds two numbers.", "Now test it."]},
    {"question_id": 2, "category": "coding", "turns": ["def fibonacci(n):", "again"]},
    {"question_id": 3, "category": "qa", "turns": ["What is the capital of France?", "Why?"]},
    {"question_id": 4, "category": "writing", "turns": ["Once upon a time there was a small model.", "More."]},
]

integration = pytest.mark.integration  # real processes or real weights


def pooled(runs, system, temperature=0.0, field=None):
    """What the report should say, recomputed here from the raw runs it was given:
    tokens per second pooled over the runs, or the median first-token ms."""
    import statistics
    group = [r for r in runs if r["system"] == system and r["temperature"] == temperature]
    assert group, system
    if field == "first_token_ms":   # the report's median, rounded as its table shows it
        return round(statistics.median(r["stats"]["first_token_ms"] for r in group), 1)
    return sum(r["new_tokens"] for r in group) / sum(r["seconds"] for r in group)


def ratio(runs, system, base, field=None):
    return pooled(runs, system, field=field) / pooled(runs, base, field=field)


@integration
def test_bench_quick_on_the_tiny_pair(tmp_path, capsys):
    questions = tmp_path / "questions.jsonl"
    questions.write_text("\n".join(json.dumps(q) for q in QUESTIONS))
    out = tmp_path / "out"
    assert bench.main(["--pair", "tiny", "--quick", "--questions", str(questions), "--categories", "coding,qa",
                       "--out", str(out)]) == 0

    report = json.loads((out / "bench.json").read_text())
    systems = ["spec-g2", "spec-g4", "spec-g6", "spec-auto", "spec-auto-model", "target-only", "hf-generate",
               "hf-assisted"]
    assert report["meta"]["systems"] == systems
    runs = report["runs"]
    # --quick: one question per category (the second coding question is left out), both temperatures.
    assert sorted({r["question_id"] for r in runs}) == ["1", "3"]
    assert len(runs) == 2 * 2 * len(systems)
    assert len((out / "runs.jsonl").read_text().splitlines()) == len(runs)  # written as they ended
    # Each system ran once before any run was measured, a few tokens, and none of it is counted.
    from specdec_tools.bench.running import WARMUP_TOKENS
    warmups = report["meta"]["warmups"]
    assert [w["system"] for w in warmups] == systems
    assert all(0 < w["new_tokens"] <= WARMUP_TOKENS < 32 for w in warmups)
    assert all(0 < r["new_tokens"] <= 32 and r["seconds"] > 0 for r in runs)
    # Every service run prefilled its prompt cold, as the in-process ones do: none found
    # what another system's run of the same prompt left in the prefix caches.
    served = [r for r in runs if not r["system"].startswith("hf-")]
    assert served and all(float(r["stats"].get("prefix_cached_tokens", 0)) == 0 for r in served)

    rows = {(r["category"], r["temperature"], r["system"]): r for r in report["summary"]}
    # Whether the adaptive systems draft at all is the policy's call on this machine's
    # cost curves: what holds for every system is asserted for all, the draft
    # columns on the fixed γ's, which always draft.
    for system in ("spec-auto", "spec-auto-model"):
        greedy = rows[("all", 0.0, system)]
        assert greedy["greedy_identical"] == "2/2"          # lossless through the real services
        # The ratios are the raw runs' own: a report that pooled, paired or rounded wrong fails here.
        assert greedy["speedup_vs_target_only"] == pytest.approx(ratio(runs, system, "target-only"), abs=2e-3)
        assert greedy["first_token_vs_target_only"] == pytest.approx(
            ratio(runs, system, "target-only", "first_token_ms"), abs=2e-3)
    for system in ("spec-g2", "spec-g4", "spec-g6"):
        greedy = rows[("all", 0.0, system)]
        assert greedy["greedy_identical"] == "2/2"
        assert 0 < greedy["acceptance_rate"] <= 1
        assert 1 <= greedy["mean_accepted_length"] <= 9
        shares = sum(greedy[f"{k}_share"] for k in ("prefill", "draft", "verify", "overhead"))
        assert abs(shares - 1) < 0.01
        assert greedy["speedup_vs_hf_assisted"] == pytest.approx(ratio(runs, system, "hf-assisted"), abs=2e-3)
        own = [r["stats"] for r in runs if r["system"] == system and r["temperature"] == 0.0]
        drafted, rounds = (sum(float(s.get(k, 0)) for s in own) for k in ("draft_tokens", "rounds"))
        assert greedy["drafted_per_round"] == pytest.approx(drafted / rounds, abs=2e-3)
        assert greedy["drafted_per_round"] <= int(system.removeprefix("spec-g"))   # never more than its γ
        # Model drafts carry their probabilities: bytes per drafted token at least an id's.
        assert greedy["draft_bytes_per_token"] >= 2 and greedy["draft_bytes_per_round"] >= greedy[
            "draft_bytes_per_token"]
        assert greedy.get("model_draft_share", 0) + greedy.get("ngram_draft_share", 0) == pytest.approx(1, abs=2e-3)
    assert "ngram_acceptance" not in rows[("all", 0.0, "spec-auto-model")]  # the model alone
    assert rows[("all", 0.0, "spec-auto")]["speedup_vs_spec_auto_model"] == pytest.approx(
        ratio(runs, "spec-auto", "spec-auto-model"), abs=2e-3)
    # Time to first token, for every system (in-process ones too), and ratios only against another system.
    assert all(0 < r["stats"]["first_token_ms"] <= r["seconds"] * 1e3 for r in runs)
    # Each run carries its GenerationStats as the proto names them: the services' whole record.
    speculative = [r["stats"] for r in runs if r["system"] == "spec-g4"]
    assert all(s["prompt_tokens"] > 0 and "draft_sources" in s and s["rounds"] > 0 for s in speculative)
    assert "first_token_vs_target_only" not in rows[("all", 0.0, "target-only")]
    assert rows[("all", 0.0, "target-only")]["speedup_vs_target_only"] == 1.0
    # coding is an MT-bench category: it is also reported pooled, as Spec-Bench's task.
    assert set(report["meta"]["best_gamma"]) == {"coding", "mt_bench", "qa", "all"}
    pick = report["meta"]["best_gamma"]["all"]["T=0"]
    fixed = {s: pooled(runs, s) for s in ("spec-g2", "spec-g4", "spec-g6")}
    assert pick["best"] == max(fixed, key=fixed.get)
    assert pick["auto_vs_best"] == pytest.approx(ratio(runs, "spec-auto", pick["best"]), abs=2e-3)
    assert "replica_vs_best" not in pick

    # The services' curves as the run left them (their Info), and what they allow speculation.
    curves = report["meta"]["curves"]
    assert curves["verifier"]["forward_ms"] and all(ms > 0 for ms in curves["verifier"]["forward_ms"])
    assert curves["drafter"]["forward_ms"] and curves["verifier"]["prefill_ms_per_token"] > 0
    assert curves["bound"].startswith("speculation on the services' cost curves: a perfect free draft")

    table = (out / "bench.md").read_text()
    assert "## the services' cost curves at the end of the run" in table and "Speculation on the services'" in table
    for heading in ("## coding, T=0", "## mt_bench, T=0", "## qa, T=0.7", "## all, T=0", "## best fixed gamma",
                    "prefill / draft / verify / overhead", "drafted / round", "first token ms (vs target-only)",
                    "ngram: share, acceptance", "draft bytes / token", "vs spec-auto-model"):
        assert heading in table
    assert table in capsys.readouterr().out
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@integration
def test_bench_replica_is_the_noise_floor_and_tasks_pool_mt_bench(tmp_path):
    questions = tmp_path / "questions.jsonl"
    questions.write_text("\n".join(json.dumps(q) for q in QUESTIONS))
    out = tmp_path / "out"
    assert bench.main(["--pair", "tiny", "--questions", str(questions), "--per-task", "1", "--max-new-tokens", "8",
                       "--temperatures", "0", "--no-hf", "--no-target-only", "--replicate-gamma", "4",
                       "--out", str(out)]) == 0
    report = json.loads((out / "bench.json").read_text())
    assert report["meta"]["systems"] == ["spec-g2", "spec-g4", "spec-g6", "spec-g4-replica", "spec-auto",
                                         "spec-auto-model"]
    runs = report["runs"]
    # --per-task 1: one question per task, but every category at least once.
    assert sorted({(r["category"], r["question_id"]) for r in runs}) == [("coding", "1"), ("qa", "3"), ("writing", "4")]
    twin = {r["question_id"]: r["token_ids"] for r in runs if r["system"] == "spec-g4"}
    assert all(r["token_ids"] == twin[r["question_id"]] for r in runs if r["system"] == "spec-g4-replica")
    picks = report["meta"]["best_gamma"]
    assert set(picks) == {"coding", "writing", "mt_bench", "qa", "all"}
    for pick in (p for temps in picks.values() for p in temps.values()):
        assert pick["best"] != "spec-g4-replica"                      # never a candidate for best
        assert pick["replica_vs_best"] <= pick["replica_vs_twin"] + 1e-3   # the best is at least the twin
    # Tasks (mt_bench, qa) are what the criterion counts, not the categories pooled into them.
    assert report["meta"]["auto_within_5pct"].endswith("/2")
    assert report["meta"]["replica_within_5pct"].endswith("/2")
    assert "replica / best" in (out / "bench.md").read_text()


def test_per_task_spreads_over_categories_and_takes_each_at_least_once(tmp_path):
    rows = [("w1", "writing"), ("w2", "writing"), ("c1", "coding"), ("c2", "coding"), ("q1", "qa"), ("q2", "qa"),
            ("q3", "qa")]
    path = tmp_path / "q.jsonl"
    path.write_text("\n".join(json.dumps({"question_id": i, "category": c, "turns": [i]}) for i, c in rows))
    ids = lambda **kw: [q.question_id for q in bench.load_questions(path, None, **kw)]  # noqa: E731
    assert ids(limit=1) == ["w1", "c1", "q1"]
    assert ids(limit=None, per_task=1) == ["w1", "c1", "q1"]            # mt_bench: both of its categories
    assert ids(limit=None, per_task=3) == ["w1", "w2", "c1", "q1", "q2", "q3"]  # round-robin within mt_bench
    assert ids(limit=None, per_task=9) == [i for i, _ in rows]          # no more than there are
    assert ids(limit=None, per_task=2, skip=1) == ["w2", "c2", "q2", "q3"]  # a second sample of prompts
    assert ids(limit=None, per_task=2, skip=2) == ["q3"]
    assert bench.task_of("roleplay") == "mt_bench" and bench.task_of("rag") == "rag"


def test_each_system_is_held_to_the_greedy_output_of_its_own_stack():
    assert bench.reference_of("spec-auto") == "target-only"
    assert bench.reference_of("spec-auto-bf16") == "target-only-bf16"
    assert bench.reference_of("hf-assisted") == "hf-generate"
    assert bench.reference_of("llama-cpp-spec") is None and bench.reference_of("target-only") is None

    def run(system, tokens, seconds=1.0):
        return bench.Run(system, "1", "qa", 0.0, len(tokens), seconds, tokens,
                         stats=dict(rounds=1, draft_tokens=2, accepted_tokens=1))
    runs = [run("target-only", [1, 2, 3]), run("spec-auto", [1, 2, 3], 0.5),
            run("target-only-bf16", [1, 2, 4], 2.0), run("spec-auto-bf16", [1, 2, 4]),
            run("llama-cpp", [9, 9, 9], 0.25)]
    systems = [r.system for r in runs]
    rows = {r["system"]: r for r in bench.summarize(runs, systems) if r["category"] == "all"}
    assert rows["spec-auto"]["greedy_identical"] == "1/1" and rows["spec-auto-bf16"]["greedy_identical"] == "1/1"
    assert "greedy_identical" not in rows["llama-cpp"]
    assert rows["spec-auto"]["speedup_vs_target_only"] == 2.0
    assert rows["spec-auto"]["speedup_vs_target_only_bf16"] == 4.0
    assert rows["llama-cpp"]["speedup_vs_target_only"] == 4.0


def test_spec_auto_is_set_against_target_only_request_by_request_where_it_did_the_same_work_and_where_not():
    from specdec_tools.bench.report import auto_by_request, markdown

    def run(system, qid, seconds, temperature=0.0, turn=1, **stats):
        return bench.Run(system, qid, "qa", temperature, 4, seconds, [1, 2, 3, 4], turn,
                         stats=dict(rounds=stats.pop("rounds", 1), **stats))
    probe = [{"kind": "lookup_wait"}]
    runs = [run("target-only", "1", 1.0), run("spec-auto", "1", 1.25),                   # same work: 0.8
            run("target-only", "1", 1.0, 0.7), run("spec-auto", "1", 0.8, 0.7),         # same work: 1.25
            run("target-only", "2", 1.0), run("spec-auto", "2", 0.5, draft_tokens=3),   # drafted: 2.0
            run("target-only", "3", 1.0), run("spec-auto", "3", 2.0, probes=probe),     # probed: 0.5
            run("target-only", "4", 1.0, rounds=4), run("spec-auto", "4", 1.0, rounds=5),  # other calls: 1.0
            run("target-only", "5", 9.0, turn=2), run("spec-auto", "5", 1.0, turn=2),   # second turns: left out
            run("spec-auto", "6", 1.0)]                                                 # no twin: left out
    got = auto_by_request(runs)
    assert got["same_work"] == dict(requests=2, lowest=0.8, median=1.025, highest=1.25)
    assert got["own_choices"] == dict(requests=3, lowest=0.5, median=1.0, highest=2.0)
    meta = dict(pair="p", draft="d", target="t", questions=6, max_new_tokens=4, temperatures=[0.0], threads=1,
                wall_s=1.0, best_gamma={}, temperature_keys=["T=0"], auto_by_request=got)
    table = markdown([], meta)
    assert "| target-only's work (no draft, no probe, as many rounds): the noise | 2 | 0.80x | 1.02x | 1.25x |" in table
    assert "best fixed gamma" not in table   # no fixed γ ran


def test_the_default_questions_are_the_dev_half_beside_the_checkout():
    import pathlib
    from specdec_tools.bench.data import DEFAULT_QUESTIONS
    root = pathlib.Path(__file__).resolve().parent.parent
    assert DEFAULT_QUESTIONS.resolve() == (root.parent / "shared/data/spec_bench/questions_dev.jsonl").resolve()


@integration
def test_second_turns_reuse_the_first_from_the_prefix_caches_and_match_their_cold_twins(tmp_path):
    questions = tmp_path / "questions.jsonl"
    questions.write_text("\n".join(json.dumps(q) for q in QUESTIONS))
    out = tmp_path / "out"
    assert bench.main(["--pair", "tiny", "--quick", "--questions", str(questions), "--categories", "writing",
                       "--gammas", "2", "--no-hf", "--no-model-only", "--turns", "2", "--out", str(out)]) == 0
    report = json.loads((out / "bench.json").read_text())
    rows = {(r["system"], r["turn"]): r for r in report["turns"]}
    assert set(rows) == {(s, t) for s in ("spec-g2", "spec-auto", "target-only") for t in (1, 2)} | {
        (s + "-cold", 2) for s in ("spec-g2", "spec-auto", "target-only")}
    for system in ("spec-g2", "spec-auto", "target-only"):
        first, second, cold = rows[(system, 1)], rows[(system, 2)], rows[(system + "-cold", 2)]
        assert second["prompt_tokens"] > first["prompt_tokens"]  # the first answer is in the history
        assert second["prefix_cached_tokens"] >= 16 and cold["prefix_cached_tokens"] == 0
        assert second["greedy_same_as_cold"] == "1/1"   # the cache changes no greedy token
        assert second["prefill_vs_cold"] > 0 and second["first_token_vs_cold"] > 0
    assert len(report["turn_runs"]) == 2 * 2 * 3        # warm and cold, both temperatures, three systems
    assert "## MT-bench, first and second turns" in (out / "bench.md").read_text()


def test_llama_cpp_that_fails_in_its_probe_is_reported_not_run(tmp_path):
    from specdec_tools.bench.systems import llama_cpp_probe
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + bytes(60))        # a header and nothing after it: llama.cpp refuses it
    why = llama_cpp_probe([broken], threads=1, timeout_s=120)
    assert why is not None and why.startswith("llama.cpp ended its probe with exit code 1"), why


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6])
def test_each_system_runs_first_and_after_each_other_system_equally_often(n):
    from collections import Counter

    from specdec_tools.bench.running import run_order
    systems = [f"s{k}" for k in range(n)]
    groups = 2 * n                                            # every row of the design, whatever n's parity
    orders = [run_order(systems, g) for g in range(groups)]
    assert all(sorted(order) == systems for order in orders)  # every system once a prompt
    firsts = Counter(order[0] for order in orders)
    follows = Counter((a, b) for order in orders for a, b in zip(order, order[1:]))
    assert len(set(firsts.values())) == 1 and len(firsts) == n
    assert len(follows) == n * (n - 1) and len(set(follows.values())) == 1, follows


@integration
def test_bench_structured_on_the_tiny_pair(tmp_path):
    out = tmp_path / "out"
    assert bench.main(["--structured", "--pair", "tiny", "--per-kind", "1", "--temperatures", "0",
                       "--max-new-tokens", "24", "--out", str(out)]) == 0
    report = json.loads((out / "structured.json").read_text())
    runs = report["runs"]
    assert {r["kind"] for r in runs} == {"json", "choice", "regex"}
    assert {r["system"] for r in runs} == {"spec-auto", "target-only"} and len(runs) == 6
    # Every output satisfies its constraint, or ended by length; speculating changed no token.
    assert all(r["valid"] or r["finish"] == "length" for r in runs)
    by = {(r["system"], r["task_id"]): r for r in runs}
    assert all(by["spec-auto", t]["token_ids"] == by["target-only", t]["token_ids"] for _, t in by)
    for row in report["summary"]:           # the report's columns are the raw runs' own
        mine = [r for r in runs if r["system"] == row["system"] and r["kind"] == row["kind"]]
        assert row["forced_share"] == pytest.approx(sum(r["forced"] for r in mine) / sum(r["new_tokens"] for r in mine))
        assert row["identical"] == 1
    assert report["meta"]["compile_ms_median"] > 0 and all(c >= 1.0 for c in report["meta"]["ceiling"].values())
    assert "| json | 0 | spec-auto |" in (out / "structured.md").read_text()
