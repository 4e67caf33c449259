#!/usr/bin/env python
"""What a drafted token costs, and where: the raw forward against the session's
propose (sampling transform, softmax, confidence, wire rounding) against the
drafter service's Propose over loopback gRPC (serialization, the torch thread
hand-off). Greedy and T=0.7, per drafted token, medians over rounds of
`--gamma` drafts after a 128-token prompt. Prints a table and writes JSON.

  python scripts/draft_step.py --model qwen2.5-coder-0.5b-instruct --quantize int8
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from drafter.draft_session import DraftSession
from drafter.service import serve
from specdec.runtime import torch_thread
from specdec.runtime.kv_cache import SequenceCache
from specdec.runtime.models import load_model
from specdec.spec.sampling import SamplingConfig
from specdec.spec.transform import sample_from, scores_to_probs, transform_logits
from specdec.rpc.serving import channel
from specdec.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc
from specdec.spec.draft_probs import encode_probs, round_probs_for_wire


def _ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--quantize", default="int8")
    parser.add_argument("--head-vocab", type=int, default=0)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="draft_step.json")
    args = parser.parse_args()
    torch_thread.set_threads(args.threads)
    loaded = torch_thread.run(load_model, args.model, dtype=args.dtype, quantize=args.quantize,
                              head_vocab=args.head_vocab)
    prompt = [(7 * i + 3) % loaded.vocab_size for i in range(128)]
    rows: dict[str, float] = {}

    def in_thread(fn):
        return lambda: torch_thread.run(fn)

    seq = torch_thread.run(SequenceCache, loaded, prompt)
    torch_thread.run(seq.prefill)
    base = len(seq)

    def raw_step():
        seq.truncate(base)
        seq.forward([], keep_last=1)
    rows["raw forward (1 row)"] = _ms(in_thread(raw_step), args.rounds * 2)
    # Everything torch runs on the torch thread: one op on another thread (an OpenMP
    # team there) slows this one's forwards by half (specdec.runtime.torch_thread).
    logits = torch_thread.run(seq.forward, [], 1)
    hot = SamplingConfig(temperature=0.7)
    rows["transform_logits T=0.7"] = _ms(in_thread(lambda: transform_logits(logits, seq.tokens, [], hot,
                                                                             loaded.vocab_size)), 50)
    scores = torch_thread.run(transform_logits, logits, seq.tokens, [], hot, loaded.vocab_size)
    rows["softmax"] = _ms(in_thread(lambda: scores_to_probs(scores)), 50)
    probs = torch_thread.run(scores_to_probs, scores)
    rows["round_probs_for_wire"] = _ms(in_thread(lambda: round_probs_for_wire(probs)), 50)
    sent = torch_thread.run(round_probs_for_wire, probs)
    generator = torch.Generator().manual_seed(0)
    rows["torch.multinomial (before)"] = _ms(in_thread(lambda: torch.multinomial(sent[0], 1, generator=generator)), 50)
    rows["sample_from (now)"] = _ms(in_thread(lambda: sample_from(sent[0], generator)), 50)
    rows["encode_probs (1 row)"] = _ms(in_thread(lambda: encode_probs(probs)), 50)
    greedy_scores = torch_thread.run(transform_logits, logits, seq.tokens, [], SamplingConfig(), loaded.vocab_size)
    rows["greedy argmax + confidence"] = _ms(in_thread(lambda: (
        int(greedy_scores[0].argmax()), float(torch.exp(greedy_scores[0, 0] - torch.logsumexp(greedy_scores[0], -1))))),
        50)

    for label, config in (("greedy", SamplingConfig()), ("T=0.7", SamplingConfig(temperature=0.7, seed=1))):
        session = torch_thread.run(DraftSession, loaded, prompt)
        start = len(session.seq)

        def propose():
            session.seq.truncate(start)
            session.round_base, session.round_drafted = start, 0
            session.propose(args.gamma, config)
        rows[f"DraftSession.propose, {label}, per token"] = _ms(in_thread(propose), args.rounds) / args.gamma

    running = serve(loaded)
    try:
        stub = drafter_pb2_grpc.DrafterStub(channel(running.address))
        for label, temperature in (("greedy", 0.0), ("T=0.7", 0.7)):
            sid = f"s-{label}"
            stub.StartSession(common_pb2.StartSessionRequest(session_id=sid, prompt_token_ids=prompt), timeout=60)
            sampling = common_pb2.SamplingParams(temperature=temperature, seed=1)
            first = stub.Propose(drafter_pb2.ProposeRequest(session_id=sid, num_tokens=args.gamma, sampling=sampling))
            assert first.draft_token_ids  # the session drafts

            def rpc():
                request = drafter_pb2.ProposeRequest(session_id=sid, num_tokens=args.gamma, sampling=sampling)
                request.commit.num_accepted = 0  # reject all: the same position every round
                request.commit.target_token_ids.append(prompt[-1])
                stub.Propose(request, timeout=60)
            rows[f"Propose over gRPC, {label}, per token"] = _ms(rpc, args.rounds) / args.gamma
    finally:
        running.stop(grace_s=0)

    width = max(len(k) for k in rows)
    print(f"{args.model} {args.dtype}+{args.quantize} head_vocab={args.head_vocab or 'all'} "
          f"gamma={args.gamma} threads={args.threads}")
    for key, value in rows.items():
        print(f"  {key:<{width}}  {value:8.2f} ms")
    with open(args.out, "w") as f:
        json.dump({"model": args.model, "dtype": args.dtype, "quantize": args.quantize, "gamma": args.gamma,
                   "head_vocab": args.head_vocab, "ms": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
