"""`specdec load` against `specdec up --pair tiny`-style subprocess services:
zero errors from 1 to 32 clients, memory back where it was, p50/p99 reported;
beyond --max-sessions, RESOURCE_EXHAUSTED and never a crash."""
from __future__ import annotations

import pytest

import json
import subprocess
import sys

pytestmark = pytest.mark.integration  # real processes or real weights


def run_load(tmp_path, *args: str) -> dict:
    out = tmp_path / "load"
    result = subprocess.run([sys.executable, "-m", "specdec_tools.load", "--pair", "tiny", "--threads", "1",
                             "--out", str(out), *args], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "| clients | requests | ok |" in result.stdout
    return json.loads((out / "load.json").read_text())


def test_load_from_1_to_32_clients_has_no_errors_and_no_leak(tmp_path):
    report = run_load(tmp_path, "--clients", "1,8,32", "--requests", "48", "--max-new-tokens", "24")
    assert [lv["clients"] for lv in report["levels"]] == [1, 8, 32]
    for lv in report["levels"]:
        assert lv["ok"] == 48 and lv["errors"] == {} and lv["refused"] == 0
        assert 0 < lv["latency_p50_s"] <= lv["latency_p99_s"] <= lv["latency_max_s"]
        assert lv["output_tokens"] == 48 * 24  # fixed length
    # The clients were served together, not one after another: at 32 the verifier's forwards
    # carried several sessions' rows on average (alone, a request's own rows).
    rows = [lv["stats"]["verify_batch_rows"] / lv["ok"] for lv in report["levels"]]
    assert rows[2] >= 2 * rows[0], rows
    before, after = report["rss_mib"]["before"], report["rss_mib"]["after"]
    assert set(before) == {"drafter", "verifier", "coordinator"} and not report["exited_early"]
    for name in before:
        assert after[name] - before[name] < max(48.0, 0.08 * before[name]), (name, before[name], after[name])


def test_admission_control_refuses_beyond_max_sessions(tmp_path):
    report = run_load(tmp_path, "--clients", "16", "--requests", "64", "--max-new-tokens", "48",
                      "--max-sessions", "4")
    (level,) = report["levels"]
    assert level["errors"] == {} and not report["exited_early"]
    assert level["refused"] > 0 and level["ok"] > 0 and level["ok"] + level["refused"] == 64


def test_systems_run_interleaved_per_level_with_drafting_batching_and_greedy_columns(tmp_path):
    report = run_load(tmp_path, "--clients", "1,4", "--per-client", "2", "--min-requests", "4",
                      "--systems", "spec-auto,target-only", "--max-new-tokens", "8", "--warmup", "0")
    assert [(lv["system"], lv["clients"], lv["requests"]) for lv in report["levels"]] == [
        ("spec-auto", 1, 4), ("target-only", 1, 4), ("spec-auto", 4, 8), ("target-only", 4, 8)]
    for lv in report["levels"]:
        assert lv["ok"] == lv["requests"] and lv["mean_stats"]["verify_batch_rows"] >= 1.0
    # Greedy prompts 0 and 2 ran alone at the first level and again under load; the fp32 tiny pair agrees.
    assert all(lv["greedy_compared"] == 2 and lv["greedy_same"] == 2 for lv in report["levels"][2:])
    assert report["levels"][1]["drafted_requests"] == 0  # target-only never drafts


def test_a_shared_system_prompt_is_prefilled_once_and_cold_requests_prefill_it_each_time(tmp_path):
    report = run_load(tmp_path, "--clients", "4", "--per-client", "2", "--systems", "target-only,target-only-cold",
                      "--system-prompt-tokens", "120", "--max-new-tokens", "8", "--warmup", "0")
    warm, cold = report["levels"]
    assert (warm["system"], cold["system"]) == ("target-only", "target-only-cold")
    assert warm["ok"] == cold["ok"] == 8 and warm["errors"] == cold["errors"] == {}
    assert warm["mean_stats"]["prompt_tokens"] > 100
    # All but the first requests (which ran at once, before any block was kept) find the system prompt.
    assert warm["mean_stats"]["prefix_cached_tokens"] >= 64
    assert cold["mean_stats"].get("prefix_cached_tokens", 0) == 0  # (a field no response set is not summed)


def test_http_and_grpc_side_by_side_and_clients_that_go_away_leave_no_session(tmp_path):
    report = run_load(tmp_path, "--clients", "4", "--requests", "12", "--max-new-tokens", "24", "--api", "both",
                      "--stream", "--drop-every", "3", "--warmup", "0")
    levels = {lv["api"]: lv for lv in report["levels"]}
    assert set(levels) == {"grpc", "http"}
    for api, lv in levels.items():
        assert lv["errors"] == {} and lv["requests"] == 12, (api, lv["error_examples"])
        assert lv["first_token_p50_ms"] > 0   # streamed: timed at the client
    assert levels["grpc"]["dropped"] == 0 and levels["grpc"]["ok"] == 12
    assert levels["http"]["dropped"] == 4 and levels["http"]["ok"] == 8      # every third client went away
    assert levels["http"]["output_tokens"] == 8 * 24
    assert report["rss_mib"]["sessions_left"] == {"drafter": 0, "verifier": 0}
