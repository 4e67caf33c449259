"""`specdec bench --structured`: structured outputs through the gRPC stack, side by
side with llama.cpp's grammar decoding, in one run on one machine.

Tasks, all from the development half of BFCL (../shared/data/bfcl/):
  json    each function's `parameters` as the JSON schema (BFCL's dialect mapped to
          JSON Schema's): "give the arguments for this request as JSON"
  choice  which of the offered functions fits the request: one of their names
  regex   whether any offered function can answer it: "Yes. ..." or "No. ...", one sentence

Systems, interleaved per task and temperature (running.run_order):
  spec-auto     the services, adaptive γ, the hybrid proposer (the grammar's forced
                tokens, lookups, the draft model), under the constraint
  spec-auto-nogrammar  the same without the grammar source (--ablate-grammar)
  target-only   the services with speculation off, under the constraint
  llama-cpp     (--llama-cpp) llama.cpp on the target's GGUF, the constraint as its grammar
                (JSON schemas through llama-cpp-python's converter, choices as GBNF; no regex)

Per output: valid (jsonschema / fullmatch / membership; `length` counts apart), the share
of tokens the grammar forced (a replay through llguidance: the token is its fast-forward),
and what a verifier forward over those forced runs would save on the verifier's own
curve (the ceiling: every forced token drafted and kept, nothing else). The engine's
compile ms and mask ms per token are measured here, on the coordinator's side.
Writes structured.json and structured.md into --out.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import re
import statistics
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field

from google.protobuf import json_format

from specdec.runtime.models import gguf_source, load_model
from specdec.spec.grammar import Constraint, GrammarCompiler
from specdec.v1 import common_pb2, coordinator_pb2 as pb, coordinator_pb2_grpc
from specdec.weights.pairs import PAIRS
from specdec_tools import launcher
from specdec_tools.bench.running import run_order
from specdec_tools.bench.systems import chat_ids, llama_cpp_probe, service_curves

BFCL = pathlib.Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "bfcl"
AUTO, AUTO_NOGRAMMAR, TARGET_ONLY, LLAMA_CPP = "spec-auto", "spec-auto-nogrammar", "target-only", "llama-cpp"
VERDICT = r"(Yes|No)\. [A-Z][^\n.]{10,100}\."


@dataclass(frozen=True)
class Task:
    task_id: str
    kind: str                       # json, choice, regex
    messages: tuple                 # chat messages
    constraint: Constraint
    schema: dict | None = None      # json: what outputs are validated against


@dataclass
class Result:
    system: str
    task_id: str
    kind: str
    temperature: float
    new_tokens: int
    seconds: float
    valid: bool
    finish: str
    token_ids: list[int] = field(repr=False)
    forced: int = 0                 # tokens the grammar forced (the replay's count)
    first_token_s: float = 0.0      # the prefill and the first token: the same work for every system
    stats: dict = field(default_factory=dict)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

    @property
    def decode_seconds(self) -> float:
        """After the first token: where the systems' decoding differs."""
        return max(self.seconds - self.first_token_s, 1e-9)


def json_schema(bfcl: dict) -> dict:
    """BFCL's parameter dialect as JSON Schema: "dict" is an object, "float" a number,
    "tuple" an array, "any" anything; descriptions and defaults dropped (not constraints)."""
    out = {}
    for key, value in bfcl.items():
        if key in ("description", "default", "optional"):
            continue
        if key == "type":
            mapped = {"dict": "object", "float": "number", "tuple": "array", "any": None}.get(value, value)
            if mapped is not None:
                out["type"] = mapped
        elif key == "properties":
            out["properties"] = {name: json_schema(prop) for name, prop in value.items()}
        elif key == "items":
            out["items"] = json_schema(value)
        else:
            out[key] = value
    if out.get("type") == "object":
        out["additionalProperties"] = False
    return out


def load_tasks(per_kind: int, skip: int = 0) -> list[Task]:
    def read(name: str) -> list[dict]:
        lines = (BFCL / name).read_text().splitlines()
        return [json.loads(line) for line in lines if line.strip()][skip:]
    tasks: list[Task] = []
    simple = read("simple_python.jsonl") + read("live_simple.jsonl")
    for entry in simple[::max(1, len(simple) // per_kind)][:per_kind]:
        function = entry["function"][0]
        schema = json_schema(function["parameters"])
        ask = (f"Give the arguments of a call to the function `{function['name']}` ({function['description']}) "
               f"that answers this request, as a JSON object.\nRequest: {entry['question'][0][-1]['content']}")
        tasks.append(Task(entry["id"], "json", ({"role": "user", "content": ask},),
                          Constraint("json_schema", json.dumps(schema)), schema))
    for entry in read("multiple.jsonl")[:per_kind]:
        names = tuple(f["name"] for f in entry["function"])
        listing = "\n".join(f"- {f['name']}: {f['description']}" for f in entry["function"])
        ask = (f"Which of these functions answers the request? Answer with its name alone.\n{listing}\n"
               f"Request: {entry['question'][0][-1]['content']}")
        tasks.append(Task(entry["id"], "choice", ({"role": "user", "content": ask},),
                          Constraint("choice", choices=names)))
    for entry in read("irrelevance.jsonl")[:per_kind]:
        listing = "\n".join(f"- {f['name']}: {f['description']}" for f in entry["function"])
        ask = (f"Can one of these functions answer the request? Answer Yes or No, then one sentence why.\n"
               f"{listing}\nRequest: {entry['question'][0][-1]['content']}")
        tasks.append(Task(entry["id"], "regex", ({"role": "user", "content": ask},), Constraint("regex", VERDICT)))
    return tasks


def valid(task: Task, text: str) -> bool:
    if task.kind == "json":
        import jsonschema
        try:
            jsonschema.validate(json.loads(text), task.schema)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if task.kind == "choice":
        return text in task.constraint.choices
    return re.fullmatch(task.constraint.text, text) is not None


def replay(compiler: GrammarCompiler, grammar: str, token_ids: list[int]) -> tuple[int, list[bool], float]:
    """(forced tokens, forced per position, mask seconds per token) of one output under
    its grammar: a position is forced where the token is the grammar's fast-forward."""
    cursor = compiler.cursor(grammar, 0)
    flags, mask_s = [], 0.0
    for token in token_ids:
        started = time.perf_counter()
        cursor.mask()
        mask_s += time.perf_counter() - started
        forced = cursor.forced()
        flags.append(bool(forced) and forced[0] == token)
        if not cursor.matcher.consume_token(token):
            break
    return sum(flags), flags, mask_s / max(len(flags), 1)


def ceiling(flags: list[bool], forward_ms: list[float]) -> float:
    """Target-only's time over the time of verifying each run of forced tokens with the
    token after it in one forward, on the verifier's curve (`forward_ms[i]`: i + 1 rows)."""
    if not flags or not forward_ms:
        return 1.0
    rounds, run = [], 0
    for forced in flags:
        if forced:
            run += 1
        else:
            rounds.append(run + 1)
            run = 0
    if run:
        rounds.append(run)
    cost = sum(forward_ms[min(rows, len(forward_ms)) - 1] * max(1, rows - len(forward_ms) + 1) for rows in rounds)
    return len(flags) * forward_ms[0] / cost


class Services:
    def __init__(self, address: str, max_new_tokens: int):
        from specdec.rpc.serving import channel
        self.channel = channel(address)
        self.stub = coordinator_pb2_grpc.CoordinatorStub(self.channel)
        self.max_new_tokens = max_new_tokens

    def run(self, system: str, task: Task, temperature: float, seed: int) -> tuple[list[int], str, float, dict]:
        c = task.constraint
        constraint = common_pb2.Constraint(
            **({"choice": common_pb2.ChoiceList(choices=c.choices)} if c.kind == "choice" else {c.kind: c.text}))
        request = pb.GenerateRequest(max_new_tokens=self.max_new_tokens, cache_salt=uuid.uuid4().hex,
                                     sampling=common_pb2.SamplingParams(temperature=temperature, seed=seed,
                                                                        constraint=constraint))
        for message in task.messages:
            request.messages.messages.add(role=message["role"], content=message["content"])
        if system == TARGET_ONLY:
            request.speculation.enabled = False
        elif system == AUTO_NOGRAMMAR:
            request.speculation.sources.extend(["ngram", "model"])
        started = time.perf_counter()
        response = self.stub.Generate(request, timeout=3600)
        seconds = time.perf_counter() - started
        finish = pb.FinishReason.Name(response.finish_reason).removeprefix("FINISH_REASON_").lower()
        return list(response.token_ids), finish, seconds, json_format.MessageToDict(
            response.stats, preserving_proto_field_name=True)


class LlamaCpp:
    def __init__(self, gguf: pathlib.Path, threads: int, context: int, max_new_tokens: int, eos: tuple[int, ...]):
        from llama_cpp import Llama
        self.llm = Llama(model_path=str(gguf), n_threads=threads, n_threads_batch=threads, n_ctx=context,
                         verbose=False)
        self.max_new_tokens, self.eos, self.grammars = max_new_tokens, set(eos), {}

    def grammar(self, task: Task):
        from llama_cpp import LlamaGrammar
        if task.task_id not in self.grammars:
            c = task.constraint
            self.grammars[task.task_id] = (
                LlamaGrammar.from_json_schema(c.text, verbose=False) if c.kind == "json_schema" else
                LlamaGrammar.from_string("root ::= " + " | ".join(json.dumps(x) for x in c.choices), verbose=False))
        return self.grammars[task.task_id]

    def run(self, task: Task, temperature: float, seed: int,
            prompt_ids: list[int]) -> tuple[list[int], str, float, float]:
        grammar = self.grammar(task)
        self.llm.reset()
        self.llm.set_seed(seed)
        out, finish, first = [], "length", 0.0
        started = time.perf_counter()
        for token in self.llm.generate(prompt_ids, reset=True, temp=temperature, top_k=0, top_p=1.0, min_p=0.0,
                                       typical_p=1.0, repeat_penalty=1.0, grammar=grammar):
            first = first or time.perf_counter() - started
            if token in self.eos:
                finish = "eos"
                break
            out.append(token)
            if len(out) >= self.max_new_tokens:
                break
        return out, finish, time.perf_counter() - started, first


def summarize(results: list[Result], systems: list[str]) -> list[dict]:
    rows = []
    for kind in sorted({r.kind for r in results}):
        for temperature in sorted({r.temperature for r in results}):
            base = {r.task_id: r for r in results if r.kind == kind and r.temperature == temperature
                    and r.system == TARGET_ONLY}
            for system in systems:
                mine = [r for r in results if r.kind == kind and r.temperature == temperature and r.system == system]
                if not mine:
                    continue
                tokens, seconds = sum(r.new_tokens for r in mine), sum(r.seconds for r in mine)
                decode_s = sum(r.decode_seconds for r in mine if r.new_tokens > 1)
                # Per task: decoding speed after the first token (the prefill is every system's same work).
                rate = lambda r: (r.new_tokens - 1) / r.decode_seconds  # noqa: E731
                speedups = [rate(r) / rate(base[r.task_id]) for r in mine
                            if r.task_id in base and r.new_tokens > 1 and base[r.task_id].new_tokens > 1]
                same = [r.token_ids == base[r.task_id].token_ids for r in mine if r.task_id in base]
                rows.append(dict(kind=kind, temperature=temperature, system=system, runs=len(mine),
                                 tokens_per_second=tokens / seconds if seconds else 0.0,
                                 decode_tokens_per_second=sum(r.new_tokens - 1 for r in mine if r.new_tokens > 1)
                                 / decode_s if decode_s else 0.0,
                                 vs_target_only=statistics.median(speedups) if speedups else None,
                                 forced_share=sum(r.forced for r in mine) / max(tokens, 1),
                                 valid=sum(r.valid for r in mine), length=sum(r.finish == "length" for r in mine),
                                 identical=sum(same) if temperature == 0 else None))
    return rows


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"Structured outputs, {meta['pair']} on {meta['threads']} threads, {meta['tasks']} BFCL tasks "
             f"(dev half), up to {meta['max_new_tokens']} new tokens. Compile {meta['compile_ms_median']:.1f} ms "
             f"median ({meta['compile_ms_max']:.1f} max); mask {meta['mask_ms_per_token']:.3f} ms a token "
             f"({meta['mask_share_of_step']:.2%} of a verifier step).", "",
             "tok/s: the whole request; decode tok/s and the ratio to target-only (the median of the tasks'): "
             "after the first token. Ceiling: what verifying each run of forced tokens in one forward gives on "
             "the verifier's curve, nothing else drafted.", "",
             "| task | T | system | tok/s | decode tok/s | vs target-only (median) | forced share | ceiling | valid "
             "| length | identical (T=0) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        versus = "" if row["vs_target_only"] is None else f"{row['vs_target_only']:.2f}x"
        identical = "" if row["identical"] is None else f"{row['identical']}/{row['runs']}"
        lines.append(f"| {row['kind']} | {row['temperature']:g} | {row['system']} | {row['tokens_per_second']:.2f} | "
                     f"{row['decode_tokens_per_second']:.2f} | {versus} | {row['forced_share']:.0%} | {meta['ceiling'].get(row['kind'], 1.0):.2f}x | "
                     f"{row['valid']}/{row['runs']} | {row['length']} | {identical} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="specdec bench --structured", description=__doc__.split("\n\n")[0])
    p.add_argument("--pair", default="qwen-coder", choices=sorted(PAIRS))
    p.add_argument("--per-kind", type=int, default=8, help="tasks of each kind (json, choice, regex)")
    p.add_argument("--skip", type=int, default=0, help="pass over each file's first N entries")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--temperatures", default="0,0.7")
    p.add_argument("--llama-cpp", action="store_true", help="also run llama.cpp with the constraint as its grammar")
    p.add_argument("--ablate-grammar", action="store_true", help="also run spec-auto without the grammar source")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench_out"))
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    say = lambda message: print(f"bench: {message}", file=sys.stderr, flush=True)  # noqa: E731
    pair = PAIRS[args.pair]
    temperatures = [float(t) for t in args.temperatures.split(",")]
    systems = [AUTO] + ([AUTO_NOGRAMMAR] if args.ablate_grammar else []) + [TARGET_ONLY] + (
        [LLAMA_CPP] if args.llama_cpp else [])
    launcher.pull_models([pair.draft, pair.target], say=say)
    if args.llama_cpp and (why := llama_cpp_probe([gguf_source(pair.target)], args.threads)):
        say(f"--llama-cpp: llama.cpp does not run on this machine, left out: {why}")
        systems.remove(LLAMA_CPP)
    target = load_model(pair.target, dtype=pair.target_dtype)
    compiler = GrammarCompiler(target.tokenizer, target.eos_token_ids)
    tasks = load_tasks(args.per_kind, args.skip)
    compiled, compile_ms = {}, []
    for task in tasks:
        started = time.perf_counter()
        compiled[task.task_id] = compiler.compile(task.constraint).grammar
        compile_ms.append((time.perf_counter() - started) * 1e3)
    prompts = {t.task_id: chat_ids(target.tokenizer, list(t.messages)) for t in tasks}
    stack = launcher.Stack(launcher.StackOptions.for_pair(pair, port=0, threads=args.threads, device=args.device))
    results: list[Result] = []
    mask_s: list[float] = []
    flags_by_kind: dict[str, list[list[bool]]] = {}
    started = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    progress = open(args.out / "structured_runs.jsonl", "w", encoding="utf-8")
    try:
        say(f"starting the {args.pair} services")
        services = Services(stack.launch().address, args.max_new_tokens)
        stack.settle(say=say)
        llama = None
        if LLAMA_CPP in systems:
            context = min(max(len(p) for p in prompts.values()) + args.max_new_tokens + 64, target.max_context)
            llama = LlamaCpp(gguf_source(pair.target), args.threads, context, args.max_new_tokens,
                             target.eos_token_ids)
        for task in tasks[:1]:   # warm-up: each system once, not counted
            for system in systems:
                if system == LLAMA_CPP:
                    llama.run(task, 0.0, args.seed, prompts[task.task_id])
                else:
                    services.run(system, task, 0.0, args.seed)
        total = len(tasks) * len(temperatures) * len(systems)
        for ti, task in enumerate(tasks):
            for temperature in temperatures:
                order = run_order(systems, ti * len(temperatures) + temperatures.index(temperature))
                for system in order:
                    if system == LLAMA_CPP and task.kind == "regex":
                        continue   # llama-cpp-python has no regex-to-GBNF converter
                    seed = args.seed + ti
                    if system == LLAMA_CPP:
                        ids, finish, seconds, first = llama.run(task, temperature, seed, prompts[task.task_id])
                        stats = {}
                    else:
                        ids, finish, seconds, stats = services.run(system, task, temperature, seed)
                        first = stats.get("first_token_ms", 0.0) / 1e3
                    text = target.tokenizer.decode(ids, skip_special_tokens=True)
                    forced, flags, per_token_s = replay(compiler, compiled[task.task_id], ids)
                    if system == TARGET_ONLY:
                        mask_s.append(per_token_s)
                        flags_by_kind.setdefault(task.kind, []).append(flags)
                    result = Result(system, task.task_id, task.kind, temperature, len(ids), seconds,
                                    valid(task, text), finish, ids, forced, first, stats)
                    results.append(result)
                    progress.write(json.dumps(asdict(result)) + "\n")
                    progress.flush()
                    say(f"[{len(results)}/{total} {time.perf_counter() - started:.0f} s] {task.kind} {task.task_id} "
                        f"T={temperature:g} {system}: {len(ids)} tokens in {seconds:.1f} s, {forced} forced, "
                        f"{'valid' if result.valid else 'INVALID'} ({finish})")
        curves = service_curves(stack, say)
    finally:
        progress.close()
        stack.stop()
    forward_ms = curves.get("verifier", {}).get("forward_ms", [])
    mask_ms = statistics.median(mask_s) * 1e3 if mask_s else 0.0
    meta = dict(pair=args.pair, threads=args.threads, tasks=len(tasks), max_new_tokens=args.max_new_tokens,
                systems=systems, temperatures=temperatures, wall_s=time.perf_counter() - started, curves=curves,
                compile_ms_median=statistics.median(compile_ms), compile_ms_max=max(compile_ms),
                mask_ms_per_token=mask_ms, mask_share_of_step=mask_ms / forward_ms[0] if forward_ms else 0.0,
                ceiling={kind: statistics.median(ceiling(f, forward_ms) for f in flags)
                         for kind, flags in flags_by_kind.items()})
    rows = summarize(results, systems)
    (args.out / "structured.json").write_text(json.dumps(
        dict(meta=meta, summary=rows, runs=[asdict(r) for r in results]), indent=1))
    table = markdown(rows, meta)
    (args.out / "structured.md").write_text(table)
    print(table)
    say(f"wrote {args.out / 'structured.json'} and {args.out / 'structured.md'}")
    return 0
