"""The GPU check's table: its sections as JSON and as markdown, written after
each one (so a call cut short still returns what it measured), and what
coordinator/gamma/bound.py predicts beside what the services measured."""
from __future__ import annotations

import dataclasses
import json
import pathlib

from coordinator.gamma.bound import best_speedup


class Report:
    def __init__(self, out: pathlib.Path, device: str, quick: bool):
        self.out = out
        self.meta = {"device": device, "quick": quick}
        self.sections: dict[str, dict] = {}

    def set(self, name: str, value, seconds: float) -> None:
        self.sections[name] = {"status": "ok", "seconds": round(seconds, 1), "value": value}
        self.write()

    def partial(self, name: str, value) -> None:
        self.sections[name] = {"status": "running", "value": value}
        self.write()

    def fail(self, name: str, error: str, trace: str, seconds: float) -> None:
        self.sections[name] = {"status": "FAILED", "seconds": round(seconds, 1), "error": error, "trace": trace,
                               "value": self.sections.get(name, {}).get("value")}
        self.write()

    def status(self, name: str) -> str:
        section = self.sections.get(name, {})
        return section.get("status", "-") + (f": {section['error']}" if "error" in section else "")

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "gpu_check.json").write_text(json.dumps({"meta": self.meta, **self.sections}, indent=2))
        (self.out / "gpu_check.md").write_text(self.markdown())

    def value(self, name: str):
        return self.sections.get(name, {}).get("value")

    def markdown(self) -> str:
        lines = [f"## GPU check ({self.meta['device']}{', quick' if self.meta['quick'] else ''})", ""]
        lines += [f"- {k}: {v}" for k, v in self.meta.items() if k not in ("device", "quick")]
        lines += ["", "| section | status | s |", "|---|---|---|"]
        lines += [f"| {name} | {self.status(name)} | {s.get('seconds', '-')} |" for name, s in self.sections.items()]
        if env := self.value("environment"):
            lines += ["", "Machine: " + ", ".join(f"{k} {v}" for k, v in env.items())]
        if steps := self.value("step costs"):
            lines += ["", *step_table(steps)]
        if static := self.value("static step"):
            lines += ["", *static_table(static)]
        if compiled := self.value("compiled step"):
            lines += ["", *static_table(compiled, f"torch.compile ({compiled['backend']}) then a CUDA graph a bucket")]
            if compiled.get("skipped"):
                lines += [f"- left out: {'; '.join(compiled['skipped'])}"]
        if argmax := self.value("argmax, k rows against 1"):
            lines += ["", f"A verification's argmax against decode steps' (target 1.5B bf16): {argmax}"]
        if pairs := self.value("services"):
            cpu = (self.meta.get("cpu_acceptance") or {}).get("greedy")
            for pair in pairs:
                lines += ["", *pair_table(pair, cpu)]
        if hf := self.value("transformers generate"):
            lines += ["", *generate_table(hf, pairs or [])]
        for name in ("tiny pair greedy", "chi-square"):
            if value := self.value(name):
                lines += ["", f"{name}: {value}"]
        for name, section in self.sections.items():
            if "trace" in section:
                lines += ["", f"### {name}", "", "```", section["trace"].rstrip(), "```"]
        return "\n".join(lines) + "\n"


def step_table(rows: list[dict]) -> list[str]:
    counts = sorted({int(n) for r in rows for n in r.get("rows_ms", {})})
    head = ["model", "B params", "load s", *[f"{n} row{'s' if n > 1 else ''} ms" for n in counts],
            "prefill ms/token (512)", "launches / 1-row step", "GPU busy / wall ms", "peak MiB", "1 row / target 1.5B's"]
    target = next((r for r in rows if r.get("label") == "target 1.5B bf16" and r.get("rows_ms")), None)
    base = target["rows_ms"][next(iter(target["rows_ms"]))] if target else None
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['label']} | " + " | ".join(["-"] * (len(head) - 2)) + f" | {r['error']} |")
            continue
        ms = {int(k): v for k, v in r["rows_ms"].items()}
        one = ms.get(1)
        out.append("| " + " | ".join(str(x) for x in [
            r["label"], r["parameters_b"], r["load_s"], *[f"{ms[n]:.2f}" if n in ms else "-" for n in counts],
            f"{r['prefill_ms_per_token']:.3f}", r["launches"], f"{r['busy_ms']:.2f} / {r['wall_ms']:.2f}",
            r["peak_mb"] or "-", f"{one / base:.2f}" if one and base else "-"]) + " |")
    return out


def static_table(static: dict, how: str = "a CUDA graph a bucket") -> list[str]:
    """The static step (one KV arena, `how`) by rows, beside the HBM floor."""
    rows = static["models"]
    counts = sorted({int(n) for r in rows for n in r.get("rows_ms", {})})
    head = ["static step", "GB read a step", "floor ms", *[f"{n} row{'s' if n > 1 else ''} ms" for n in counts],
            "1 row / floor", "8 rows / 1", "16 rows / 1", "8 rows / 1 at 1k context",
            "4 greedy steps: read each / read behind / chained ms", "4 sampled draft steps: read each / chained ms",
            "graphs (capture s)",
            "greedy as the lean forward's"]
    out = [f"Static step ({how}), device copy bandwidth {static['copy_gbps']} GB/s:", "",
           "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['label']} | " + " | ".join(["-"] * (len(head) - 2)) + f" | {r['error']} |")
            continue
        ms = {int(k): v for k, v in r["rows_ms"].items()}
        greedy = r.get("greedy", {})
        agreed = f"{greedy.get('agreed')}/{greedy.get('of')}" + (
            f" (then {greedy['first_difference_bf16_steps']} bf16 steps apart)"
            if "first_difference_bf16_steps" in greedy else "")
        out.append("| " + " | ".join(str(x) for x in [
            r["label"], r["weights_gb"], r.get("floor_ms") or "-", *[f"{ms[n]:.3f}" if n in ms else "-" for n in counts],
            r.get("one_row_over_floor", "-"), r.get("ratio_8", "-"), r.get("ratio_16", "-"), r.get("long_ratio_8", "-"),
            " / ".join(str(r.get("chain_ms", {}).get(k, "-")) for k in ("read_each", "read_behind", "chained")),
            " / ".join(str(r.get("chain_ms", {}).get(k, "-")) for k in ("sampled_read_each", "sampled_chained")),
            f"{r['graphs']} ({r['capture_s']})",
            agreed]) + " |")
    out += [f"- {r['label']}: graph capture failed, timed eager: {r['capture_error']}"
            for r in rows if r.get("capture_error")]
    return out


def generate_table(hf: dict, pairs: list[dict]) -> list[str]:
    """transformers' generate() beside target-only through the services, decode ms per token."""
    served = {"target 1.5B bf16": "0.5B -> 1.5B", "target 7B bf16": "0.5B -> 7B"}
    services = {p["pair"]: next((r["ms_per_token"] for r in p.get("runs", []) if r["system"] == "target-only"), None)
                for p in pairs}
    out = ["transformers' generate() (static cache, torch.compile) against target-only through the services:", "",
           "| target | generate() ms / token | compiled (warm-up s) | services target-only ms / token | "
           "services / generate() |", "|---|---|---|---|---|"]
    for r in hf["models"]:
        if "error" in r:
            out.append(f"| {r['label']} | - | - | - | {r['error']} |")
            continue
        mine = services.get(served.get(r["label"], ""))
        ratio = f"{mine / r['decode_ms_per_token']:.2f}" if mine and r["decode_ms_per_token"] > 0 else "-"
        out.append(f"| {r['label']} | {r['decode_ms_per_token']:.3f} | {r['compiled']} ({r['warm_up_s']}) | "
                   f"{mine if mine is not None else '-'} | {ratio} |")
    if hf.get("skipped"):
        out.append(f"- left out: {'; '.join(hf['skipped'])}")
    return out


def pair_dict(result) -> dict:
    return {"pair": result.pair, "draft_curve": result.draft_curve, "verify_curve": result.verify_curve,
            "draft_curve_after": result.draft_curve_after, "verify_curve_after": result.verify_curve_after,
            "runs": [dataclasses.asdict(r) for r in result.runs], "skipped": result.skipped}


def predicted(pair: dict, acceptance: float) -> tuple[float, int] | None:
    """What the bound makes of the services' curves at `acceptance`: the best speedup and its γ."""
    if len(pair.get("verify_curve") or []) < 2 or not pair.get("draft_curve"):
        return None
    return best_speedup(pair["verify_curve"], pair["draft_curve"][0], acceptance)


def pair_table(pair: dict, cpu_acceptance: float | None) -> list[str]:
    runs = pair.get("runs", [])
    base = next((r["ms_per_token"] for r in runs if r["system"] == "target-only"), None)
    out = [f"Pair {pair['pair']} through the services (synthetic acceptance; decode ms per token after the "
           "first; speedup against target-only):", "",
           "| acceptance | system | ms / token | speedup | first draft kept | mean accepted length | drafted a round | "
           "round outside the forwards, ms | of it, the calls as calls (RPC), ms | stats marked |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        speed = f"{base / r['ms_per_token']:.2f}x" if base and r["ms_per_token"] else "-"
        outside, rpc = ("-" if r.get(key) is None else f"{r[key]:.2f}"
                        for key in ("outside_ms_per_round", "rpc_ms_per_round"))
        out.append(f"| {r['acceptance']} | {r['system']} | {r['ms_per_token']:.2f} | {speed} | {r['acceptance_seen']} | "
                   f"{r['mean_accepted_length']} | {r['drafted_per_round']} | {outside} | {rpc} | "
                   f"{round(r['synthetic'], 3) or '-'} |")
    alphas = sorted({r["acceptance"] for r in runs} | ({cpu_acceptance} if cpu_acceptance else set()))
    bounds = [(a, predicted(pair, a)) for a in alphas]
    if any(b for _, b in bounds):
        out += ["", "bound.py on the services' curves (draft step " +
                f"{pair['draft_curve'][0]:.2f} ms, verify by rows {', '.join(f'{x:.2f}' for x in pair['verify_curve'][:9])} "
                "ms): " + "; ".join(f"acceptance {a}{' (the real pair on the CPU)' if a == cpu_acceptance else ''}: "
                                    f"{b[0]:.2f}x at γ={b[1]}" for a, b in bounds if b)]
    if pair.get("verify_curve_after") and pair.get("draft_curve_after"):
        # The live curves read the forwards' device time: near warm-up's, not a launch's tenth of a ms.
        out += ["", "The services' curves after the runs, kept current from the forwards served (warm-up's "
                f"beside): draft step {pair['draft_curve_after'][0]:.2f} ms ({pair['draft_curve'][0]:.2f}), "
                f"verify 1 row {pair['verify_curve_after'][0]:.2f} ms ({pair['verify_curve'][0]:.2f})"]
    if pair.get("skipped"):
        out += ["", "skipped: " + "; ".join(pair["skipped"])]
    return out
