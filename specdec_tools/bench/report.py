"""The summary of a bench run: per category and task, the best fixed γ, the table and the chart."""
from __future__ import annotations

import pathlib
import statistics
from collections import defaultdict

from specdec_tools.bench.data import (AUTO, AUTO_MODEL, BF16, COLD, HF_ASSISTED, HF_GENERATE, LLAMA_CPP, REPLICA, Run,
                                      TARGET_ONLY, TARGET_ONLY_BF16, task_of)


def reference_of(system: str) -> str | None:
    """The system whose greedy output `system` must reproduce token for token, if any:
    speculation against target-only of the same stack, assisted against plain
    generate. llama.cpp computes with other kernels, so nothing is expected of it."""
    if system.startswith(LLAMA_CPP) or system in (TARGET_ONLY, TARGET_ONLY_BF16, HF_GENERATE):
        return None
    if system == HF_ASSISTED:
        return HF_GENERATE
    return TARGET_ONLY_BF16 if system.endswith(BF16) else TARGET_ONLY


def summarize(runs: list[Run], systems: list[str]) -> list[dict]:
    """One row per (group, temperature, system). Groups: each category, each
    Spec-Bench task that pools several (mt_bench), and 'all'; in that order."""
    by_key: dict[tuple, list[Run]] = defaultdict(list)
    for run in runs:
        for category in dict.fromkeys((run.category, task_of(run.category), "all")):
            by_key[(category, run.temperature, run.system)].append(run)
    reference = {(r.system, r.question_id, r.temperature): r for r in runs}
    rows = []
    for (category, temperature, system), group in sorted(by_key.items(), key=lambda kv: (
            kv[0][0] == "all", task_of(kv[0][0]) == kv[0][0], kv[0][0], kv[0][1], systems.index(kv[0][2]))):
        tokens, seconds = sum(r.new_tokens for r in group), sum(r.seconds for r in group)
        row = dict(category=category, temperature=temperature, system=system, runs=len(group), new_tokens=tokens,
                   seconds=round(seconds, 3), tokens_per_second=round(tokens / seconds, 3) if seconds else 0.0)
        drafted, accepted, rounds = (round(sum(r.stat(k) for r in group)) for k in (
            "draft_tokens", "accepted_tokens", "rounds"))
        firsts = [r.first_token_ms for r in group if r.first_token_ms > 0]
        if firsts:
            row["first_token_ms"] = round(statistics.median(firsts), 1)
        if drafted:
            row["drafted_per_round"] = round(drafted / rounds, 3)
            prefill_s, draft_s, verify_s = (sum(r.stat(k) for r in group) / 1e3 for k in (
                "prefill_ms", "draft_ms", "verify_ms"))
            row.update(acceptance_rate=round(accepted / drafted, 4),
                       mean_accepted_length=round((accepted + rounds) / rounds, 3),
                       prefill_share=round(prefill_s / seconds, 3),
                       draft_share=round(draft_s / seconds, 3), verify_share=round(verify_s / seconds, 3),
                       overhead_share=round(1 - (prefill_s + draft_s + verify_s) / seconds, 3))
            drafting_rounds = sum(r.drafting_rounds for r in group)
            draft_bytes = sum(r.stat("draft_bytes") for r in group)
            row.update(draft_bytes_per_token=round(draft_bytes / drafted, 1),
                       draft_bytes_per_round=round(draft_bytes / drafting_rounds, 1) if drafting_rounds else 0.0)
            for source in ("ngram", "model"):
                counts = [r.sources[source] for r in group if source in r.sources]
                source_drafted = sum(int(c.get("draft_tokens", 0)) for c in counts)
                if source_drafted:
                    row[f"{source}_draft_share"] = round(source_drafted / drafted, 3)
                    row[f"{source}_acceptance"] = round(
                        sum(int(c.get("accepted_tokens", 0)) for c in counts) / source_drafted, 4)
        if temperature == 0 and reference_of(system):
            same = [r.token_ids == reference[key].token_ids for r in group
                    if (key := (reference_of(system), r.question_id, r.temperature)) in reference]
            row["greedy_identical"] = f"{sum(same)}/{len(same)}"
        rows.append(row)
    speed = {(r["category"], r["temperature"], r["system"]): r["tokens_per_second"] for r in rows}
    for row in rows:
        key = (row["category"], row["temperature"])
        for name, base in (("speedup_vs_target_only", TARGET_ONLY), ("speedup_vs_target_only_bf16", TARGET_ONLY_BF16),
                           ("speedup_vs_hf_assisted", HF_ASSISTED), ("speedup_vs_spec_auto_model", AUTO_MODEL)):
            if speed.get((*key, base)):
                row[name] = round(row["tokens_per_second"] / speed[(*key, base)], 3)
    # Time to first token against target-only of the same precision (the bf16 stack's against its own).
    first = {(r["category"], r["temperature"], r["system"]): r.get("first_token_ms") for r in rows}
    for row in rows:
        base = TARGET_ONLY_BF16 if row["system"].endswith(BF16) else TARGET_ONLY
        mine, theirs = row.get("first_token_ms"), first.get((row["category"], row["temperature"], base))
        if mine and theirs and row["system"] != base:
            row["first_token_vs_target_only"] = round(mine / theirs, 3)
    return rows


def auto_by_request(runs: list[Run]) -> dict[str, dict]:
    """spec-auto against target-only request by request (first turns), as target-only's
    seconds over spec-auto's: where spec-auto did target-only's work (drafted nothing, took
    no probe, as many rounds), what the machine's noise alone does to one request's ratio
    in this run; where it drafted or probed, what its choices got. A task's ratio is a
    pool of a few requests, so one below the first kind's lowest is more than noise."""
    auto = {(r.question_id, r.temperature): r for r in runs if r.system == AUTO and r.turn == 1}
    ratios: dict[str, list[float]] = defaultdict(list)
    for base in runs:
        mine = auto.get((base.question_id, base.temperature))
        if base.system != TARGET_ONLY or base.turn != 1 or mine is None or mine.seconds <= 0:
            continue
        same = not mine.stat("draft_tokens") and not mine.stats.get("probes") and \
            mine.stat("rounds") == base.stat("rounds")
        ratios["same_work" if same else "own_choices"].append(base.seconds / mine.seconds)
    return {kind: dict(requests=len(v), lowest=round(min(v), 3), median=round(statistics.median(v), 3),
                       highest=round(max(v), 3)) for kind, v in ratios.items()}


def best_gamma(rows: list[dict]) -> dict[str, dict[str, dict]]:
    """Per group and temperature: the fastest fixed γ, and auto's speed relative
    to it. With a replica (`--replicate-gamma`), the replica's too: it does the
    same work as a fixed γ, so its ratio is what noise alone does to a system
    that is exactly as good as a fixed γ. Picking the best of several noisy
    systems is biased upward, and the replica shows by how much."""
    speed = {(r["category"], r["temperature"], r["system"]): r["tokens_per_second"] for r in rows}
    replica = next((s for (_, _, s) in speed if s.endswith(REPLICA)), None)
    picks: dict[str, dict[str, dict]] = defaultdict(dict)
    for (group, temperature, system), tps in speed.items():
        if not system.startswith("spec-g") or system.endswith(REPLICA):
            continue
        pick = picks[group].setdefault(f"T={temperature:g}", dict(temperature=temperature, best=system,
                                                                   best_tokens_per_second=tps))
        if tps > pick["best_tokens_per_second"]:
            pick.update(best=system, best_tokens_per_second=tps)
    for group, temps in picks.items():
        for pick in temps.values():
            temperature, best = pick["temperature"], pick["best_tokens_per_second"]
            if (group, temperature, AUTO) in speed:
                pick["auto_vs_best"] = round(speed[(group, temperature, AUTO)] / best, 3)
            if replica is not None:
                mine, twin = (speed[(group, temperature, s)] for s in (replica, replica.removesuffix(REPLICA)))
                pick["replica_vs_best"], pick["replica_vs_twin"] = round(mine / best, 3), round(mine / twin, 3)
    return dict(picks)


def within(picks: dict[str, dict[str, dict]], groups: list[str], field: str, margin: float = 0.05) -> str:
    """'k/n': in how many (group, temperature) cells `field` is within `margin` of the best fixed γ."""
    cells = [pick[field] for g in groups for pick in picks.get(g, {}).values() if field in pick]
    return f"{sum(c >= 1 - margin for c in cells)}/{len(cells)}"


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"# specdec bench: {meta['pair']} ({meta['draft']} -> {meta['target']})", "",
             f"{meta['questions']} questions, {meta['max_new_tokens']} new tokens, "
             f"temperatures {meta['temperatures']}, torch threads {meta['threads']}, {meta['wall_s']:.0f} s in all. "
             "tok/s counts output tokens over client-side wall time, prefill included.", ""]
    header = ("| system | tok/s | vs target-only | vs target-only-bf16 | vs hf-assisted | vs spec-auto-model | "
              "acceptance | drafted / round | mean acc. len | ngram: share, acceptance | model acceptance | "
              "draft bytes / token | first token ms (vs target-only) | "
              "prefill / draft / verify / overhead | greedy identical |")
    for category in dict.fromkeys(r["category"] for r in rows):
        for temperature in dict.fromkeys(r["temperature"] for r in rows if r["category"] == category):
            lines += [f"## {category}, T={temperature:g}", "", header, "|" + "---|" * 15]
            for r in rows:
                if r["category"] != category or r["temperature"] != temperature:
                    continue
                split = " / ".join(f"{r[k + '_share']:.0%}" for k in ("prefill", "draft", "verify", "overhead")) \
                    if "draft_share" in r else ""
                speedups = [f"{r[k]:.2f}x" if k in r else "" for k in (
                    "speedup_vs_target_only", "speedup_vs_target_only_bf16", "speedup_vs_hf_assisted",
                    "speedup_vs_spec_auto_model")]
                ngram = f"{r['ngram_draft_share']:.0%}, {r['ngram_acceptance']:.2f}" if "ngram_acceptance" in r else ""
                first = f"{r['first_token_ms']:.0f}" if "first_token_ms" in r else ""
                if "first_token_vs_target_only" in r:
                    first += f" ({r['first_token_vs_target_only']:.2f}x)"
                lines.append(
                    f"| {r['system']} | {r['tokens_per_second']:.2f} | {' | '.join(speedups)} | "
                    f"{r.get('acceptance_rate', '')} | {r.get('drafted_per_round', '')} | "
                    f"{r.get('mean_accepted_length', '')} | {ngram} | {r.get('model_acceptance', '')} | "
                    f"{r.get('draft_bytes_per_token', '')} | {first} | {split} | {r.get('greedy_identical', '')} |")
            lines.append("")
    lines += _best_gamma_lines(meta)
    if meta.get("auto_by_request"):
        labels = {"same_work": "target-only's work (no draft, no probe, as many rounds): the noise",
                  "own_choices": "drafted or probed"}
        lines += ["", "## spec-auto against target-only, request by request", "",
                  "Each request's speed against target-only's on the same prompt and temperature. Where "
                  "spec-auto did the same work, the spread is the machine's alone.", "",
                  "| spec-auto | requests | lowest | median | highest |", "|---|---|---|---|---|"]
        lines += [f"| {labels[kind]} | {v['requests']} | {v['lowest']:.2f}x | {v['median']:.2f}x | "
                  f"{v['highest']:.2f}x |" for kind in labels if (v := meta["auto_by_request"].get(kind))]
    if meta.get("curves"):
        lines += ["", "## the services' cost curves at the end of the run", "",
                  "| service | ms by rows 1, 2, 3, … | prefill ms / token |", "|---|---|---|"]
        lines += [f"| {name} | {', '.join(f'{ms:g}' for ms in curve['forward_ms'])} | "
                  f"{curve['prefill_ms_per_token']:g} |" for name, curve in meta["curves"].items() if name != "bound"]
        bound = meta["curves"]["bound"]
        lines += ["", bound[:1].upper() + bound[1:] + "."]
    return "\n".join(lines) + "\n"


def _best_gamma_lines(meta: dict) -> list[str]:
    """The best fixed γ per group against auto (and the replica): none where no fixed γ ran."""
    picks, keys = meta["best_gamma"], meta["temperature_keys"]
    if not picks:
        return []
    replica = any("replica_vs_best" in pick for temps in picks.values() for pick in temps.values())
    fields = {"auto_vs_best": "auto / best"} | (
        {"replica_vs_best": "replica / best", "replica_vs_twin": "replica / twin"} if replica else {})
    columns = ["best fixed", *fields.values()]
    lines = ["## best fixed gamma, and auto's speed relative to it", "",
             "Spec-Bench tasks first (MT-bench's categories pooled), then the categories. "
             + ("The replica repeats a fixed γ, same work and same outputs: its ratios are the noise floor. "
                if replica else "") + "A ratio of 0.95 or more is within 5% of the best.", "",
             "| group | " + " | ".join(f"{k}: {c}" for k in keys for c in columns) + " |",
             "|---|" + "---|" * (len(keys) * len(columns))]
    tasks = [g for g in picks if g == "all" or task_of(g) == g]
    for group in tasks + [g for g in picks if g not in tasks]:
        cells = []
        for key in keys:
            pick = picks[group].get(key, {})
            cells.append(f"{pick['best']} {pick['best_tokens_per_second']:.2f}" if pick else "")
            cells += [f"{pick[f]:.2f}x" if f in pick else "" for f in fields]
        lines.append(f"| {group} | " + " | ".join(cells) + " |")
    lines += ["", f"Within 5% of the best fixed γ, Spec-Bench tasks and temperatures: auto {meta['auto_within_5pct']}"
              + (f", replica {meta['replica_within_5pct']}" if replica else "") + "."]
    return lines


def turn_summary(runs: list[Run]) -> list[dict]:
    """--turns 2: per system, its first turns, its second turns as served, and the
    same second turns cold (SYSTEM-cold: a cache salt of their own). Medians over
    the questions and temperatures; the ratios pair each second turn with its cold twin."""
    groups: dict[tuple[str, int], list[Run]] = defaultdict(list)
    for run in runs:
        groups[(run.system, run.turn)].append(run)
    cold = {(r.system.removesuffix(COLD), r.question_id, r.temperature): r for r in runs if r.system.endswith(COLD)}
    rows = []
    for (system, turn), group in groups.items():
        tokens, seconds = sum(r.new_tokens for r in group), sum(r.seconds for r in group)
        row = dict(system=system, turn=turn, runs=len(group),
                   prompt_tokens=round(statistics.median(r.stat("prompt_tokens") for r in group)),
                   prefix_cached_tokens=round(statistics.median(r.stat("prefix_cached_tokens") for r in group)),
                   draft_prefix_cached_tokens=round(statistics.median(
                       r.stat("draft_prefix_cached_tokens") for r in group)),
                   first_token_ms=round(statistics.median(r.first_token_ms for r in group), 1),
                   prefill_ms=round(statistics.median(r.stat("prefill_ms") for r in group), 1),
                   tokens_per_second=round(tokens / seconds, 3) if seconds else 0.0)
        twins = [(r, cold[(system, r.question_id, r.temperature)]) for r in group
                 if turn == 2 and not system.endswith(COLD) and (system, r.question_id, r.temperature) in cold]
        if twins:
            row["first_token_vs_cold"] = round(statistics.median(
                r.first_token_ms / c.first_token_ms for r, c in twins if c.first_token_ms > 0), 3)
            row["prefill_vs_cold"] = round(statistics.median(
                r.stat("prefill_ms") / c.stat("prefill_ms") for r, c in twins if c.stat("prefill_ms") > 0), 3)
            greedy = [(r, c) for r, c in twins if r.temperature == 0]
            if greedy:
                row["greedy_same_as_cold"] = f"{sum(r.token_ids == c.token_ids for r, c in greedy)}/{len(greedy)}"
        rows.append(row)
    rows.sort(key=lambda r: (r["system"].removesuffix(COLD), r["turn"], r["system"].endswith(COLD)))
    return rows


def turn_markdown(rows: list[dict]) -> str:
    lines = ["", "## MT-bench, first and second turns", "",
             "A second turn re-sends the first turn and its answer; the model services' prefix caches hold them. "
             "SYSTEM-cold is the same second turn with a cache salt of its own (nothing cached). "
             "prefill ms covers the verifier's prefill and first token and the drafter's prefill.", "",
             "| system | turn | runs | prompt tokens | cached (target, draft) | prefill ms | first token ms | "
             "tok/s | prefill vs cold | first token vs cold | greedy same as cold |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    ratio = lambda r, key: f"{r[key]:.2f}x" if key in r else ""  # noqa: E731
    for r in rows:
        lines.append(f"| {r['system']} | {r['turn']} | {r['runs']} | {r['prompt_tokens']} | "
                     f"{r['prefix_cached_tokens']}, {r['draft_prefix_cached_tokens']} | {r['prefill_ms']:.0f} | "
                     f"{r['first_token_ms']:.0f} | {r['tokens_per_second']:.2f} | {ratio(r, 'prefill_vs_cold')} | "
                     f"{ratio(r, 'first_token_vs_cold')} | {r.get('greedy_same_as_cold', '')} |")
    return "\n".join(lines) + "\n"


def chart(rows: list[dict], systems: list[str], out: pathlib.Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temperatures = list(dict.fromkeys(r["temperature"] for r in rows))
    categories = list(dict.fromkeys(r["category"] for r in rows))
    fig, axes = plt.subplots(len(temperatures), 1, figsize=(max(8, 1.2 * len(categories) * len(systems) / 3),
                                                           3.5 * len(temperatures)), squeeze=False)
    width = 0.8 / len(systems)
    speed = {(r["category"], r["temperature"], r["system"]): r["tokens_per_second"] for r in rows}
    for ax, temperature in zip(axes[:, 0], temperatures):
        for i, system in enumerate(systems):
            ax.bar([c + i * width for c in range(len(categories))],
                   [speed.get((cat, temperature, system), 0) for cat in categories], width, label=system)
        ax.set_xticks([c + 0.4 - width / 2 for c in range(len(categories))], categories, rotation=20, fontsize=8)
        ax.set_ylabel("tokens/s")
        ax.set_title(f"T={temperature:g}")
    axes[0, 0].legend(fontsize=7, ncol=len(systems))
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


# --- main ---------------------------------------------------------------------
