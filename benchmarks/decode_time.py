#!/usr/bin/env python
"""Where a target-only decoded token's time goes, layer by layer of the path:

  forward     the model's 1-row forward and an argmax, on the torch thread, in a loop
  session     the verifier session's decode steps (logit transform, sampling), inline
  scheduler   the same steps through the batching scheduler, called from another thread
  Decode RPC  the verifier service (its own process) over its Unix socket, 16 tokens a call
  Generate    the coordinator's target-only GenerateStream, from its first token to its last
  Generate, spec-auto  the same with the default speculation (adaptive γ, lookups and the draft
              model): where drafting does not pay, what its rounds cost over target-only's

Each is ms per token after the same chat prompts (Spec-Bench dev questions): the
pair's stack runs beside a copy of its target loaded in this process (as the
pair's verifier loads it), every path runs once per repeat in turn, so all see
the same machine (it drifts by more than the differences over minutes), and the
table gives the median of the repeats. This process's OpenMP workers sleep as
soon as the services' do. Prints a table and writes JSON.

  python benchmarks/decode_time.py [--pair qwen-coder] [--tokens 64] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time
import uuid

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from specdec.runtime import torch_thread  # noqa: E402

torch_thread.spin_briefly()  # before torch loads: as the model services

from specdec.rpc.serving import channel  # noqa: E402
from specdec.runtime.sequence import SequenceCache, run_steps  # noqa: E402
from specdec.runtime.models import load_model  # noqa: E402
from specdec.service.model_service import new_scheduler  # noqa: E402
from specdec.spec.sampling import SamplingConfig  # noqa: E402
from specdec.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc, verifier_pb2, verifier_pb2_grpc  # noqa: E402
from specdec.weights.pairs import PAIRS  # noqa: E402
from specdec_tools import launcher  # noqa: E402
from specdec_tools.bench.data import DEFAULT_QUESTIONS, load_questions  # noqa: E402
from specdec_tools.bench.systems import chat_ids  # noqa: E402
from verifier.target_session import TargetSession  # noqa: E402

CHUNK = 16  # as the coordinator's target-only Decode calls
GREEDY = SamplingConfig()


def in_process(options: launcher.StackOptions, texts: list[str], tokens: int) -> tuple[dict, list[list[int]]]:
    loaded = load_model(options.target_model, dtype=options.target_dtype,
                        quantize=options.target_quantize)
    scheduler = new_scheduler(loaded)
    prompts = [chat_ids(loaded.tokenizer, t) for t in texts]

    def forward(ids: list[int]) -> float:
        seq = SequenceCache(loaded, ids)
        seq.prefill()

        def loop() -> float:
            run_steps(seq.step([], keep_last=1))  # the prompt's last token: not a decoded one
            started = time.perf_counter()
            for _ in range(tokens):
                logits = run_steps(seq.step([], keep_last=1))
                seq.append([int(logits[0].argmax())])
            return (time.perf_counter() - started) * 1e3 / tokens
        return torch_thread.run(loop)

    def session(ids: list[int]) -> float:
        s = TargetSession(loaded, ids)
        torch_thread.run(run_steps, s.decode_steps(1, GREEDY))
        started = time.perf_counter()
        out = torch_thread.run(run_steps, s.decode_steps(tokens, GREEDY))
        return (time.perf_counter() - started) * 1e3 / len(out)

    def scheduled(ids: list[int]) -> float:
        s = TargetSession(loaded, ids)
        scheduler.run(s.decode_steps(1, GREEDY))
        started, made = time.perf_counter(), 0
        while made < tokens:
            made += len(scheduler.run(s.decode_steps(min(CHUNK, tokens - made), GREEDY))[0])
        return (time.perf_counter() - started) * 1e3 / made

    return {"forward": forward, "session": session, "scheduler": scheduled}, prompts


def over_rpc(verifier, coordinator, tokens: int) -> dict:
    def decode(ids: list[int]) -> float:
        sid = f"decode-time-{uuid.uuid4().hex}"
        verifier.StartSession(common_pb2.StartSessionRequest(session_id=sid, prompt_token_ids=ids,
                                                             cache_salt=uuid.uuid4().bytes))
        try:
            verifier.Decode(verifier_pb2.DecodeRequest(session_id=sid, num_tokens=1))
            started, made = time.perf_counter(), 0
            while made < tokens:
                asked = min(CHUNK, tokens - made)
                reply = verifier.Decode(verifier_pb2.DecodeRequest(session_id=sid, num_tokens=asked))
                made += len(reply.token_ids)
                if len(reply.token_ids) < asked:
                    break  # an EOS
            return (time.perf_counter() - started) * 1e3 / made
        finally:
            verifier.EndSession(common_pb2.EndSessionRequest(session_id=sid))

    def generate(text: str, speculate: bool = False) -> float:
        request = coordinator_pb2.GenerateRequest(max_new_tokens=tokens + 1, ignore_eos=True,
                                                  cache_salt=uuid.uuid4().hex)
        request.messages.messages.add(role="user", content=text)
        request.speculation.enabled = speculate
        first, count = None, 0
        for message in coordinator.GenerateStream(request, timeout=600):
            if first is None and message.token_ids:
                first, count = time.perf_counter(), len(message.token_ids) - 1
            else:
                count += len(message.token_ids)
        return (time.perf_counter() - first) * 1e3 / max(count, 1)

    return {"Decode RPC": decode, "Generate": generate,
            "Generate, spec-auto": lambda text: generate(text, speculate=True)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default="qwen-coder", choices=sorted(PAIRS))
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=2, help="Spec-Bench dev questions (coding, writing, ...)")
    parser.add_argument("--out", default="decode_time.json")
    args = parser.parse_args()
    options = launcher.StackOptions.for_pair(PAIRS[args.pair], port=0)
    questions = load_questions(DEFAULT_QUESTIONS, ["coding", "writing", "math_reasoning", "rag"], 1)[:args.prompts]
    texts = [q.prompt for q in questions]
    launcher.pull_models([options.draft_model, options.target_model])
    stack = launcher.Stack(options)
    try:
        coordinator_child = stack.launch()  # first, so the services time their curves on a quiet machine
        systems, prompts = in_process(options, texts, args.tokens)
        with channel(stack.child("verifier").address) as vch, channel(coordinator_child.address) as cch:
            verifier = verifier_pb2_grpc.VerifierStub(vch)
            one_row_ms = verifier.Info(common_pb2.InfoRequest()).forward_ms[0]
            systems.update(over_rpc(verifier, coordinator_pb2_grpc.CoordinatorStub(cch), args.tokens))
            times = {name: [] for name in systems}
            for _ in range(args.repeats):
                for name, run in systems.items():
                    inputs = texts if name.startswith("Generate") else prompts
                    times[name].append(statistics.mean(run(x) for x in inputs))
    finally:
        stack.stop()
    base = statistics.median(times["forward"])
    rows = [{"path": name, "ms_per_token": statistics.median(v), "runs": v,
             "over_forward_ms": statistics.median(v) - base} for name, v in times.items()]
    print(f"\n{args.pair} target ({options.target_quantize}), {args.tokens} tokens after prompts of "
          f"{', '.join(str(len(p)) for p in prompts)} tokens; the verifier's warm-up 1-row forward: {one_row_ms:.1f} ms")
    print("| path | ms a token | over the forward |\n|---|---|---|")
    for r in rows:
        print(f"| {r['path']} | {r['ms_per_token']:.2f} | {r['over_forward_ms']:+.2f} |")
    pathlib.Path(args.out).write_text(json.dumps({"pair": args.pair, "tokens": args.tokens,
                                                  "prompt_tokens": [len(p) for p in prompts],
                                                  "warm_up_one_row_ms": one_row_ms, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
