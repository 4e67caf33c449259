"""`specdec bench`: Spec-Bench prompts through the full gRPC stack, side by side
with the peers, in one run on one machine.

Systems, run interleaved (each prompt runs every system before the next prompt,
in an order rotated per prompt, so drift in machine load is shared):
  spec-gN      speculative decoding through the services, fixed gamma N
  spec-auto    the same, gamma chosen per round by the coordinator's controller
               (drafts stop early after a token the drafter is unsure of), with
               the default hybrid proposer: n-gram lookups (free) and the model
  spec-auto-model  the same with the draft model alone (--no-model-only skips it)
  spec-auto-nostop  the same without that early stop (--ablate-confidence-stop)
  spec-gN-replica  (--replicate-gamma N) spec-gN once more, as a separate system:
               identical work, so its distance from spec-gN and from the best
               fixed gamma is the run's own noise floor
  target-only  the same services with speculation off
  target-only-bf16, spec-auto-bf16  (unless --no-bf16) a second stack with the
               target in bf16 (`specdec up --target-quantize none`): the
               precision where verifying rows is nearly free
  hf-generate  in-process transformers `generate()` with the target in bf16
  hf-assisted  in-process transformers assisted generation, `assistant_model=`
               the same (INT8) draft weights: the peer a user would otherwise pick
  llama-cpp    (--llama-cpp) llama.cpp through llama-cpp-python on the target's
               own GGUF file: the fastest CPU engine, target alone
  llama-cpp-spec  (--llama-cpp) the same with the pair's draft GGUF through the
               binding's draft hook (greedy drafts of 4 tokens)

Results are grouped by category and by Spec-Bench task: the eight MT-bench
categories pool into `mt_bench`, as Spec-Bench itself reports them; the other
five tasks are one category each.

Writes bench.json (every run, plus the summary), bench.md (a table per
category and temperature) and bench.png into --out.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
from transformers.generation.streamers import BaseStreamer

from specdec.tools import launcher
from specdec import torch_thread
from specdec.models import LoadedModel, gguf_source, load_model
from specdec.pairs import PAIRS
from specdec.serving import channel
from specdec.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

DEFAULT_QUESTIONS = pathlib.Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "spec_bench" / \
    "questions_dev.jsonl"
TARGET_ONLY, HF_GENERATE, HF_ASSISTED, AUTO = "target-only", "hf-generate", "hf-assisted", "spec-auto"
BF16 = "-bf16"
TARGET_ONLY_BF16, AUTO_BF16 = TARGET_ONLY + BF16, AUTO + BF16
LLAMA_CPP, LLAMA_CPP_SPEC = "llama-cpp", "llama-cpp-spec"
LLAMA_CPP_DRAFT = 4  # tokens per round for llama-cpp-spec
AUTO_NOSTOP = "spec-auto-nostop"
AUTO_MODEL = "spec-auto-model"
REPLICA = "-replica"
MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")


def task_of(category: str) -> str:
    """Spec-Bench's task for a category: its six tasks, MT-bench's eight categories pooled."""
    return "mt_bench" if category in MT_BENCH else category


@dataclass(frozen=True)
class Question:
    question_id: str
    category: str
    prompt: str


@dataclass
class Run:
    system: str
    question_id: str
    category: str
    temperature: float
    new_tokens: int
    seconds: float
    token_ids: list[int] = field(repr=False)
    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    prefill_ms: float = 0.0
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    first_token_ms: float = 0.0  # from the call until the first token was decided
    sources: dict = field(default_factory=dict)  # per draft source: {rounds, draft_tokens, accepted_tokens}
    draft_bytes: int = 0         # draft data sent to the verifier
    drafting_rounds: int = 0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


def load_questions(path: pathlib.Path, categories: list[str] | None, limit: int | None,
                   per_task: int | None = None, skip: int = 0) -> list[Question]:
    """First turns of Spec-Bench questions. `limit` applies per category;
    `per_task` takes that many per Spec-Bench task, round-robin over the task's
    categories, and at least one of each category. `skip` passes over each
    category's first questions (a second sample of prompts)."""
    by_category: dict[str, list[Question]] = defaultdict(list)
    with open(path, encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            category = row["category"]
            if categories and category not in categories:
                continue
            by_category[category].append(Question(str(row["question_id"]), category, row["turns"][0]))
    by_category = {c: qs[skip:] for c, qs in by_category.items() if qs[skip:]}
    if per_task is not None:
        tasks: dict[str, list[list[Question]]] = defaultdict(list)
        for category, qs in by_category.items():
            tasks[task_of(category)].append(qs)
        chosen = {q.question_id for members in tasks.values() for q in _round_robin(members, per_task)}
        questions = [q for qs in by_category.values() for q in qs if q.question_id in chosen]
    else:
        questions = [q for qs in by_category.values() for q in qs[:limit]]
    if not questions:
        raise SystemExit(f"bench: no questions in {path} for categories {categories}")
    return questions


def _round_robin(members: list[list[Question]], n: int) -> list[Question]:
    """n questions (at least one per category) taken in turn from each category's list."""
    taken, depth, want = [], 0, max(n, len(members))
    while len(taken) < want and any(depth < len(qs) for qs in members):
        taken += [qs[depth] for qs in members if depth < len(qs)][: want - len(taken)]
        depth += 1
    return taken


class ServiceSystems:
    """spec-gN and target-only: Generate calls to the coordinator over gRPC."""

    def __init__(self, address: str, max_new_tokens: int):
        self.channel = channel(address)
        self.stub = coordinator_pb2_grpc.CoordinatorStub(self.channel)
        self.max_new_tokens = max_new_tokens

    def run(self, system: str, question: Question, temperature: float, seed: int, prompt_ids: list[int]) -> Run:
        mode = system.removesuffix(BF16)  # the bf16 stack serves the same systems
        request = coordinator_pb2.GenerateRequest(max_new_tokens=self.max_new_tokens)
        request.messages.messages.add(role="user", content=question.prompt)
        request.sampling.CopyFrom(common_pb2.SamplingParams(temperature=temperature, seed=seed))
        if mode == TARGET_ONLY:
            request.speculation.enabled = False
        elif mode in (AUTO, AUTO_NOSTOP, AUTO_MODEL):
            # No gamma: the coordinator's default, auto. A seeded sample would be
            # served at a fixed gamma (reproducibility), so auto runs unseeded.
            request.sampling.ClearField("seed")
            if mode == AUTO_NOSTOP:
                request.speculation.confidence_stop = False
            if mode == AUTO_MODEL:
                request.speculation.proposer = coordinator_pb2.PROPOSER_KIND_MODEL
        else:
            request.speculation.gamma = int(mode.removeprefix("spec-g").removesuffix(REPLICA))
        start = time.perf_counter()
        response = self.stub.Generate(request, timeout=3600)
        seconds = time.perf_counter() - start
        stats = response.stats
        # The services and the in-process baselines must see the same prompt.
        assert stats.prompt_tokens == len(prompt_ids), (stats.prompt_tokens, len(prompt_ids))
        return Run(system, question.question_id, question.category, temperature, len(response.token_ids), seconds,
                   list(response.token_ids), stats.rounds, stats.draft_tokens, stats.accepted_tokens,
                   stats.prefill_ms, stats.draft_ms, stats.verify_ms, stats.first_token_ms,
                   {d.source: dict(rounds=d.rounds, draft_tokens=d.draft_tokens, accepted_tokens=d.accepted_tokens)
                    for d in stats.draft_sources}, stats.draft_bytes,
                   round(stats.draft_bytes / stats.draft_bytes_per_round) if stats.draft_bytes_per_round else 0)

    def close(self) -> None:
        self.channel.close()


class InProcessSystems:
    """hf-generate and hf-assisted: transformers in this process, same weights."""

    def __init__(self, target: LoadedModel, draft: LoadedModel, max_new_tokens: int):
        self.target, self.draft, self.max_new_tokens = target, draft, max_new_tokens

    @torch_thread.runs_on_it  # where the models were loaded: one OpenMP team in this process
    def run(self, system: str, question: Question, temperature: float, seed: int, prompt_ids: list[int]) -> Run:
        ids = torch.tensor([prompt_ids], device=self.target.device)
        sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else dict(
            do_sample=False, temperature=None, top_k=None, top_p=None)
        extra = dict(assistant_model=self.draft.model) if system == HF_ASSISTED else {}
        torch.manual_seed(seed)
        start = time.perf_counter()
        first = _FirstToken()
        with torch.no_grad():
            out = self.target.model.generate(ids, attention_mask=torch.ones_like(ids),
                                             max_new_tokens=self.max_new_tokens, streamer=first,
                                             pad_token_id=self.target.eos_token_ids[0], **sampling, **extra)
        seconds = time.perf_counter() - start
        new = out[0, ids.shape[1]:].tolist()
        # Count as the services do: output stops before the first EOS.
        eos = set(self.target.eos_token_ids)
        cut = next((i for i, t in enumerate(new) if t in eos), len(new))
        return Run(system, question.question_id, question.category, temperature, cut, seconds, new[:cut],
                   first_token_ms=(first.at - start) * 1e3 if first.at else 0.0)


class _FirstToken(BaseStreamer):
    """When generate() put out its first new token (its first put() is the prompt)."""

    def __init__(self):
        self.puts, self.at = 0, 0.0

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.at = time.perf_counter()

    def end(self) -> None:
        pass


class LlamaCppSystems:
    """llama-cpp and llama-cpp-spec: llama.cpp on the pair's GGUF files, in this process,
    same prompt ids. The binding's draft hook takes any proposer; here it is the draft
    GGUF, greedy, LLAMA_CPP_DRAFT tokens a round (the binding asks for logits of every
    row then, prefill included: its cost, not ours)."""

    def __init__(self, target_gguf: pathlib.Path, draft_gguf: pathlib.Path | None, threads: int,
                 max_new_tokens: int, eos_ids: tuple[int, ...], context: int):
        try:
            from llama_cpp import Llama
        except ImportError as error:
            raise SystemExit("bench: --llama-cpp needs llama-cpp-python: pip install llama-cpp-python "
                             "(it compiles llama.cpp; a few minutes)") from error
        options = dict(n_threads=threads, n_threads_batch=threads, n_ctx=context, verbose=False)
        self.engines = {LLAMA_CPP: Llama(model_path=str(target_gguf), **options)}
        if draft_gguf is not None:
            draft = _LlamaCppDraft(Llama(model_path=str(draft_gguf), **options), LLAMA_CPP_DRAFT)
            # logits_all=True said explicitly: the binding turns it on for a draft model but
            # sizes its score buffer from the argument (n_batch rows), which a prompt
            # longer than one batch overruns.
            self.engines[LLAMA_CPP_SPEC] = Llama(model_path=str(target_gguf), draft_model=draft, logits_all=True,
                                                 **options)
        self.max_new_tokens, self.eos = max_new_tokens, set(eos_ids)

    @torch_thread.runs_on_it  # as the in-process transformers systems
    def run(self, system: str, question: Question, temperature: float, seed: int, prompt_ids: list[int]) -> Run:
        llm = self.engines[system]
        llm.reset()  # no prefix reuse from the previous run
        if llm.draft_model is not None:
            llm.draft_model.llm.reset()
        llm.set_seed(seed)
        sampling = dict(temp=temperature, top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0, repeat_penalty=1.0)
        out: list[int] = []
        start = time.perf_counter()
        first_token_ms = 0.0
        for token in llm.generate(prompt_ids, reset=True, **sampling):
            first_token_ms = first_token_ms or (time.perf_counter() - start) * 1e3
            if token in self.eos:
                break
            out.append(token)
            if len(out) >= self.max_new_tokens:
                break
        seconds = time.perf_counter() - start
        return Run(system, question.question_id, question.category, temperature, len(out), seconds, out,
                   first_token_ms=first_token_ms)


class _LlamaCppDraft:
    """A draft model for llama-cpp-python's `draft_model` hook: another GGUF, greedy.
    Its KV cache follows the target's by prefix match (the binding keeps what matches)."""

    def __init__(self, llm, num_tokens: int):
        self.llm, self.num_tokens = llm, num_tokens

    def __call__(self, input_ids, **kwargs):
        drafted = []
        for token in self.llm.generate(input_ids.tolist(), reset=True, temp=0.0, top_k=1):  # keeps the matching prefix
            drafted.append(token)
            if len(drafted) >= self.num_tokens:
                break
        return np.array(drafted, dtype=np.intc)


def reference_of(system: str) -> str | None:
    """The system whose greedy output `system` must reproduce token for token, if any:
    speculation against target-only of the same stack, assisted against plain
    generate. llama.cpp computes with other kernels, so nothing is expected of it."""
    if system.startswith(LLAMA_CPP) or system in (TARGET_ONLY, TARGET_ONLY_BF16, HF_GENERATE):
        return None
    if system == HF_ASSISTED:
        return HF_GENERATE
    return TARGET_ONLY_BF16 if system.endswith(BF16) else TARGET_ONLY


def chat_ids(tokenizer, prompt: str) -> list[int]:
    """The coordinator's own recipe for `messages` (template as text, then encode)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


# --- summary ------------------------------------------------------------------

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
        drafted, accepted, rounds = (sum(getattr(r, k) for r in group) for k in (
            "draft_tokens", "accepted_tokens", "rounds"))
        firsts = [r.first_token_ms for r in group if r.first_token_ms > 0]
        if firsts:
            row["first_token_ms"] = round(statistics.median(firsts), 1)
        if drafted:
            row["drafted_per_round"] = round(drafted / rounds, 3)
            prefill_s, draft_s, verify_s = (sum(getattr(r, k) for r in group) / 1e3 for k in (
                "prefill_ms", "draft_ms", "verify_ms"))
            row.update(acceptance_rate=round(accepted / drafted, 4),
                       mean_accepted_length=round((accepted + rounds) / rounds, 3),
                       prefill_share=round(prefill_s / seconds, 3),
                       draft_share=round(draft_s / seconds, 3), verify_share=round(verify_s / seconds, 3),
                       overhead_share=round(1 - (prefill_s + draft_s + verify_s) / seconds, 3))
            drafting_rounds, draft_bytes = (sum(getattr(r, k) for r in group) for k in ("drafting_rounds",
                                                                                         "draft_bytes"))
            row.update(draft_bytes_per_token=round(draft_bytes / drafted, 1),
                       draft_bytes_per_round=round(draft_bytes / drafting_rounds, 1) if drafting_rounds else 0.0)
            for source in ("ngram", "model"):
                counts = [r.sources[source] for r in group if source in r.sources]
                source_drafted = sum(c["draft_tokens"] for c in counts)
                if source_drafted:
                    row[f"{source}_draft_share"] = round(source_drafted / drafted, 3)
                    row[f"{source}_acceptance"] = round(sum(c["accepted_tokens"] for c in counts) / source_drafted,
                                                        4)
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
    picks, keys = meta["best_gamma"], meta["temperature_keys"]
    replica = any("replica_vs_best" in pick for temps in picks.values() for pick in temps.values())
    fields = {"auto_vs_best": "auto / best"} | (
        {"replica_vs_best": "replica / best", "replica_vs_twin": "replica / twin"} if replica else {})
    columns = ["best fixed", *fields.values()]
    lines += ["## best fixed gamma, and auto's speed relative to it", "",
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

def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="specdec bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--pair", default="qwen-coder", choices=sorted(PAIRS))
    p.add_argument("--questions", type=pathlib.Path, default=DEFAULT_QUESTIONS)
    p.add_argument("--categories", help="comma-separated (default: all)")
    p.add_argument("--limit", type=int, help="questions per category")
    p.add_argument("--skip", type=int, default=0, help="pass over each category's first N questions")
    p.add_argument("--per-task", type=int,
                   help="questions per Spec-Bench task instead, spread over its categories (at least one each)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--gammas", default="2,4,6")
    p.add_argument("--temperatures", default="0,0.7")
    p.add_argument("--no-hf", action="store_true", help="skip the in-process transformers baselines")
    p.add_argument("--no-target-only", action="store_true", help="skip target-only (no speedups against it)")
    p.add_argument("--no-model-only", action="store_true",
                   help="skip spec-auto-model (auto γ, the draft model alone: no n-gram lookups)")
    p.add_argument("--no-bf16", action="store_true",
                   help="skip the second stack (bf16 target)")
    p.add_argument("--llama-cpp", action="store_true",
                   help="also run llama.cpp on the target's GGUF (needs llama-cpp-python)")
    p.add_argument("--replicate-gamma", type=int, metavar="N",
                   help="run spec-gN twice, as spec-gN and spec-gN-replica: the run's own noise floor")
    p.add_argument("--ablate-confidence-stop", action="store_true",
                   help="also run spec-auto without the draft-confidence early stop")
    p.add_argument("--quick", action="store_true",
                   help="under 5 minutes: one question of each of 3 short-prompt categories, 32 new tokens")
    p.add_argument("--threads", type=int, default=2, help="torch threads, for the services and in-process alike")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench_out"))
    args = p.parse_args(argv)
    if args.replicate_gamma is not None and str(args.replicate_gamma) not in args.gammas.split(","):
        p.error(f"--replicate-gamma {args.replicate_gamma} must be one of --gammas ({args.gammas})")
    if args.quick:
        args.limit = args.limit or 1
        args.max_new_tokens = min(args.max_new_tokens, 32)
        # Short prompts, so the few tokens measure decoding rather than prefill.
        args.categories = args.categories or "coding,math_reasoning,translation"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    torch_thread.set_threads(args.threads)
    pair = PAIRS[args.pair]
    categories = args.categories.split(",") if args.categories else None
    questions = load_questions(args.questions, categories, args.limit, args.per_task, args.skip)
    temperatures = [float(t) for t in args.temperatures.split(",")]
    systems = [f"spec-g{int(g)}" for g in args.gammas.split(",") if g] + [AUTO] + (
        [] if args.no_model_only else [AUTO_MODEL]) + ([] if args.no_target_only else [TARGET_ONLY])
    if not args.no_bf16 and pair.target_quantize != "none":
        systems += [AUTO_BF16, TARGET_ONLY_BF16]
    if args.llama_cpp:
        systems += [LLAMA_CPP, LLAMA_CPP_SPEC]
    if args.replicate_gamma is not None:
        systems.insert(systems.index(AUTO), f"spec-g{args.replicate_gamma}{REPLICA}")
    if args.ablate_confidence_stop:
        systems.insert(systems.index(AUTO) + 1, AUTO_NOSTOP)
    if not args.no_hf:
        systems += [HF_GENERATE, HF_ASSISTED]
    say = lambda message: print(f"bench: {message}", file=sys.stderr, flush=True)  # noqa: E731
    launcher.pull_models([pair.draft, pair.target], say=say)
    options = launcher.StackOptions.for_pair(pair, port=0, threads=args.threads)
    stack = launcher.Stack(options)
    stacks = [stack]
    started = time.perf_counter()
    try:
        say(f"starting the {args.pair} services")
        coordinator = stack.launch()
        services = ServiceSystems(coordinator.address, args.max_new_tokens)
        bf16_services = None
        if AUTO_BF16 in systems:
            say("starting the bf16 stack (bf16 target)")
            stacks.append(launcher.Stack(launcher.StackOptions.for_pair(
                pair, port=0, threads=args.threads, target_quantize="none")))
            bf16_services = ServiceSystems(stacks[-1].launch().address, args.max_new_tokens)
        target = load_model(pair.target, dtype=pair.target_dtype)
        in_process = None
        if not args.no_hf:
            draft = load_model(pair.draft, dtype=pair.draft_dtype, quantize=pair.draft_quantize,
                               head_vocab=pair.draft_head_vocab)
            in_process = InProcessSystems(target, draft, args.max_new_tokens)
        runs: list[Run] = []
        prompts = {q: chat_ids(target.tokenizer, q.prompt) for q in questions}
        llama = None
        if args.llama_cpp:
            context = min(max(len(p) for p in prompts.values()) + args.max_new_tokens + 64, target.max_context)
            llama = LlamaCppSystems(gguf_source(pair.target), gguf_source(pair.draft), args.threads,
                                    args.max_new_tokens, target.eos_token_ids, context)
        too_long = [q for q in questions if len(prompts[q]) + args.max_new_tokens > target.max_context]
        for q in too_long:
            say(f"skipping {q.category} q{q.question_id}: {len(prompts[q])} prompt tokens + {args.max_new_tokens} "
                f"exceed the target's context window ({target.max_context})")
        questions = [q for q in questions if q not in too_long]
        total = len(questions) * len(temperatures) * len(systems)
        args.out.mkdir(parents=True, exist_ok=True)
        progress = open(args.out / "runs.jsonl", "w", encoding="utf-8")  # every run as it ends: a crash loses none
        for qi, question in enumerate(questions):
            prompt_ids = prompts[question]
            for temperature in temperatures:
                shift = (qi * len(temperatures) + temperatures.index(temperature)) % len(systems)
                for system in systems[shift:] + systems[:shift]:
                    runner = (in_process if system in (HF_GENERATE, HF_ASSISTED) else
                              llama if system.startswith(LLAMA_CPP) else
                              bf16_services if system.endswith(BF16) else services)
                    run = runner.run(system, question, temperature, args.seed + qi, prompt_ids)
                    runs.append(run)
                    progress.write(json.dumps(asdict(run)) + "\n")
                    progress.flush()
                    say(f"[{len(runs)}/{total} {time.perf_counter() - started:.0f} s] {question.category} "
                        f"q{question.question_id} T={temperature:g} "
                        f"{system}: {run.new_tokens} tokens in {run.seconds:.1f} s "
                        f"({run.tokens_per_second:.2f} tok/s)")
        services.close()
        progress.close()
    finally:
        for one in stacks:
            one.stop()
    rows = summarize(runs, systems)
    picks = best_gamma(rows)
    tasks = sorted({task_of(q.category) for q in questions})
    meta = dict(pair=args.pair, draft=pair.draft, target=pair.target, questions=len(questions),
                skipped=[f"{q.category}/{q.question_id}" for q in too_long],
                max_new_tokens=args.max_new_tokens, temperatures=temperatures, threads=args.threads,
                systems=systems, wall_s=time.perf_counter() - started,
                temperature_keys=[f"T={t:g}" for t in temperatures], best_gamma=picks,
                auto_within_5pct=within(picks, tasks, "auto_vs_best"),
                replica_within_5pct=within(picks, tasks, "replica_vs_best"),
                median_tokens_per_second={s: statistics.median(r.tokens_per_second for r in runs if r.system == s)
                                          for s in systems})
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench.json").write_text(json.dumps(
        dict(meta=meta, summary=rows, runs=[asdict(r) for r in runs]), indent=1))
    table = markdown(rows, meta)
    (args.out / "bench.md").write_text(table)
    chart(rows, systems, args.out / "bench.png")
    print(table)
    say(f"wrote {args.out / 'bench.json'}, {args.out / 'bench.md'}, {args.out / 'bench.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
