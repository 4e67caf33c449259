"""`specdec traces PATH`: read OTLP-JSON lines written with --trace-file and show,
per request, where acceptance and time went.

Per round: γ, the draft's source (ngram: a lookup, free; model: the draft
model; ngram+model: both, in that order), drafted, accepted, draft bytes sent,
draft ms and verify ms (the coordinator's client spans of Propose and Verify)
and RPC ms (client minus server span time of both calls: network,
serialization and queueing). Per request: acceptance by draft position and per
source, the split of the time, and tokens/s.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from dataclasses import dataclass, field


@dataclass
class Span:
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    kind: str
    start_ns: int
    end_ns: int
    service: str
    attributes: dict
    children: list["Span"] = field(default_factory=list)

    @property
    def ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


def _value(v: dict):
    for key in ("stringValue", "boolValue", "doubleValue"):
        if key in v:
            return v[key]
    if "intValue" in v:
        return int(v["intValue"])
    if "arrayValue" in v:
        return [_value(x) for x in v["arrayValue"].get("values", [])]
    return None


def read_spans(path: str) -> list[Span]:
    spans = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            for resource in json.loads(line).get("resourceSpans", []):
                attrs = {a["key"]: _value(a["value"]) for a in resource.get("resource", {}).get("attributes", [])}
                service = attrs.get("service.name", "?")
                for scope in resource.get("scopeSpans", []):
                    for s in scope.get("spans", []):
                        spans.append(Span(
                            s["traceId"], s["spanId"], s.get("parentSpanId", ""), s["name"], s.get("kind", ""),
                            int(s["startTimeUnixNano"]), int(s["endTimeUnixNano"]), service,
                            {a["key"]: _value(a["value"]) for a in s.get("attributes", [])}))
    by_id = {s.span_id: s for s in spans}
    for s in spans:
        if s.parent_id in by_id:
            by_id[s.parent_id].children.append(s)
    for s in spans:
        s.children.sort(key=lambda c: c.start_ns)
    return spans


def _call(round_span: Span, method: str) -> tuple[float, float]:
    """(client ms, client - server ms) of a round's call to `method`, 0 if absent."""
    for child in round_span.children:
        if child.name.endswith(f"/{method}") and "CLIENT" in child.kind:
            server = next((c for c in child.children if c.name == child.name), None)
            return child.ms, child.ms - server.ms if server else 0.0
    return 0.0, 0.0


@dataclass
class RoundRow:
    index: int
    gamma: int
    drafted: int
    accepted: int
    draft_ms: float
    verify_ms: float
    rpc_ms: float
    source: str = ""
    draft_bytes: int = 0
    by_source: dict[str, tuple[int, int]] = field(default_factory=dict)  # source -> (drafted, accepted)


def rounds_of(generate: Span) -> list[RoundRow]:
    rows = []
    for r in (c for c in generate.children if c.name == "round"):
        draft_ms, draft_rpc = _call(r, "Propose")
        verify_ms, verify_rpc = _call(r, "Verify")
        a = r.attributes
        rows.append(RoundRow(a.get("specdec.round.index", len(rows)), a.get("specdec.gamma", 0),
                             a.get("specdec.draft_tokens", 0), a.get("specdec.accepted_tokens", 0),
                             draft_ms or a.get("specdec.draft_ms", 0.0), verify_ms or a.get("specdec.verify_ms", 0.0),
                             draft_rpc + verify_rpc, a.get("specdec.draft.source", ""), a.get("specdec.draft_bytes", 0),
                             _source_counts(a)))
    return rows


def _source_counts(attributes: dict) -> dict[str, tuple[int, int]]:
    """A round span's specdec.draft.<source>.draft_tokens / .accepted_tokens, by source."""
    out = {}
    for key, drafted in attributes.items():
        if key.startswith("specdec.draft.") and key.endswith(".draft_tokens"):
            source = key[len("specdec.draft."): -len(".draft_tokens")]
            out[source] = (drafted, attributes.get(f"specdec.draft.{source}.accepted_tokens", 0))
    return out


def report(generate: Span, out=sys.stdout) -> dict:
    rows = rounds_of(generate)
    print(f"request {generate.trace_id}  model {generate.attributes.get('gen_ai.request.model', '?')}  "
          f"{generate.ms:.0f} ms", file=out)
    print(f"{'round':>5} {'γ':>3} {'source':>11} {'drafted':>7} {'accepted':>8} {'bytes':>7} {'draft ms':>9} "
          f"{'verify ms':>9} {'rpc ms':>7}", file=out)
    for r in rows:
        print(f"{r.index:>5} {r.gamma:>3} {r.source or '-':>11} {r.drafted:>7} {r.accepted:>8} {r.draft_bytes:>7} "
              f"{r.draft_ms:>9.1f} {r.verify_ms:>9.1f} {r.rpc_ms:>7.1f}", file=out)
    drafted_at, accepted_at = defaultdict(int), defaultdict(int)
    for r in rows:
        for i in range(r.drafted):
            drafted_at[i] += 1
            accepted_at[i] += i < r.accepted
    by_position = [accepted_at[i] / drafted_at[i] for i in sorted(drafted_at)]
    draft, verify, rpc = (sum(getattr(r, k) for r in rows) for k in ("draft_ms", "verify_ms", "rpc_ms"))
    output_tokens = generate.attributes.get("gen_ai.usage.output_tokens", 0)
    summary = dict(
        request=generate.trace_id, rounds=len(rows), drafted=sum(r.drafted for r in rows),
        accepted=sum(r.accepted for r in rows), acceptance_by_position=[round(a, 3) for a in by_position],
        draft_ms=round(draft, 1), verify_ms=round(verify, 1), rpc_ms=round(rpc, 1),
        other_ms=round(generate.ms - draft - verify, 1), output_tokens=output_tokens,
        tokens_per_second=round(output_tokens / (generate.ms / 1e3), 2) if generate.ms else 0.0,
        sources=_by_source(rows), draft_bytes=sum(r.draft_bytes for r in rows))
    acceptance = summary["accepted"] / summary["drafted"] if summary["drafted"] else 0.0
    print(f"summary: {summary['rounds']} rounds, {summary['drafted']} drafted, {summary['accepted']} accepted "
          f"({acceptance:.2f}); acceptance by position {summary['acceptance_by_position']}", file=out)
    for source, counts in summary["sources"].items():
        print(f"  {source}: {counts['drafted']} drafted, {counts['accepted']} accepted "
              f"({counts['acceptance']:.2f}) in {counts['rounds']} rounds", file=out)
    print(f"time: draft {draft:.0f} ms ({draft / generate.ms:.0%}), verify {verify:.0f} ms "
          f"({verify / generate.ms:.0%}), of which RPC {rpc:.0f} ms; other {summary['other_ms']:.0f} ms; "
          f"{output_tokens} tokens at {summary['tokens_per_second']:.2f} tok/s", file=out)
    return summary


def _by_source(rows: list[RoundRow]) -> dict[str, dict]:
    """Drafted and accepted per source, over the rounds."""
    out: dict[str, dict] = {}
    for r in rows:
        for source, (drafted, accepted) in r.by_source.items():
            if drafted:
                counts = out.setdefault(source, dict(rounds=0, drafted=0, accepted=0))
                counts["rounds"] += 1
                counts["drafted"] += drafted
                counts["accepted"] += accepted
    for counts in out.values():
        counts["acceptance"] = round(counts["accepted"] / counts["drafted"], 3)
    return out


def plot(generate: Span, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = rounds_of(generate)
    x = [r.index for r in rows]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    top.bar(x, [r.draft_ms for r in rows], label="draft")
    top.bar(x, [r.verify_ms for r in rows], bottom=[r.draft_ms for r in rows], label="verify")
    top.plot(x, [r.rpc_ms for r in rows], "k.", label="rpc")
    top.set_ylabel("ms")
    top.legend(fontsize=8)
    bottom.bar(x, [r.drafted for r in rows], color="lightgray", label="drafted (γ)")
    bottom.bar(x, [r.accepted for r in rows], color="tab:green", label="accepted")
    bottom.set_xlabel("round")
    bottom.legend(fontsize=8)
    fig.suptitle(f"request {generate.trace_id[:16]}…")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specdec traces", description=__doc__.split("\n\n")[0])
    parser.add_argument("path", help="an OTLP-JSON lines file written with --trace-file")
    parser.add_argument("--request", help="a trace id (or its prefix); default: every request")
    parser.add_argument("--plot", help="write a PNG of the (last) request's rounds")
    parser.add_argument("--json", action="store_true", help="print the summaries as JSON")
    args = parser.parse_args(argv)
    requests = [s for s in read_spans(args.path) if s.name == "generate"]
    if args.request:
        requests = [s for s in requests if s.trace_id.startswith(args.request)]
    if not requests:
        print(f"no generate spans{' for ' + args.request if args.request else ''} in {args.path}", file=sys.stderr)
        return 1
    summaries = []
    for generate in sorted(requests, key=lambda s: s.start_ns):
        summaries.append(report(generate, out=sys.stderr if args.json else sys.stdout))
        if not args.json:
            print()
    if args.json:
        print(json.dumps(summaries, indent=1))
    if args.plot:
        plot(requests[-1], args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
