"""The bench's questions, tasks and system names, and one run's record."""
from __future__ import annotations

import json
import pathlib
import time
from collections import defaultdict
from dataclasses import dataclass, field

from google.protobuf import json_format

from specdec.v1 import coordinator_pb2


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
COLD = "-cold"  # a second turn again, with a cache salt of its own: no prefix-cache hits
MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")


def task_of(category: str) -> str:
    """Spec-Bench's task for a category: its six tasks, MT-bench's eight categories pooled."""
    return "mt_bench" if category in MT_BENCH else category


@dataclass(frozen=True)
class Question:
    question_id: str
    category: str
    prompt: str
    second_turn: str = ""   # MT-bench's follow-up question, asked after the first answer ("" where none)


@dataclass
class Run:
    system: str
    question_id: str
    category: str
    temperature: float
    new_tokens: int
    seconds: float
    token_ids: list[int] = field(repr=False)
    turn: int = 1            # 2: a second turn, the first answer in its history
    # The run's GenerationStats (specdec.v1) as JSON, field names as in the proto:
    # the services' own, or those an in-process system measures (first_token_ms).
    # A statistic added to the proto reaches runs.jsonl and bench.json as it is.
    stats: dict = field(default_factory=dict)
    # When the run ended (Unix seconds), to line a slow run up with the machine's own records
    # (/proc/stat's steal time, other processes): on a shared machine one request's noise can
    # exceed what separates two systems (report.auto_by_request).
    ended_at: float = field(default_factory=time.time)

    @classmethod
    def of(cls, system: str, question: Question, temperature: float, token_ids: list[int], seconds: float,
           stats: coordinator_pb2.GenerationStats, turn: int = 1) -> "Run":
        return cls(system, question.question_id, question.category, temperature, len(token_ids), seconds,
                   list(token_ids), turn, json_format.MessageToDict(stats, preserving_proto_field_name=True))

    def stat(self, name: str) -> float:
        """A GenerationStats field (0 where unset; 64-bit ones travel in JSON as strings)."""
        return float(self.stats.get(name, 0))

    @property
    def first_token_ms(self) -> float:
        return self.stat("first_token_ms")

    @property
    def sources(self) -> dict[str, dict]:
        """Per draft source ("model", "ngram"): its DraftSourceStats."""
        return {s["source"]: s for s in self.stats.get("draft_sources", [])}

    @property
    def drafting_rounds(self) -> int:
        per_round = self.stat("draft_bytes_per_round")
        return round(self.stat("draft_bytes") / per_round) if per_round else 0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


def load_questions(path: pathlib.Path, categories: list[str] | None, limit: int | None,
                   per_task: int | None = None, skip: int = 0) -> list[Question]:
    """Spec-Bench questions (their first turns, and MT-bench's second). `limit` applies per category;
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
            turns = row["turns"]
            by_category[category].append(Question(str(row["question_id"]), category, turns[0],
                                                  turns[1] if len(turns) > 1 else ""))
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
