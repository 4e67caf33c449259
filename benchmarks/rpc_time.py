#!/usr/bin/env python
"""Per-round RPC time over loopback TCP against Unix domain sockets, on the tiny pair.

Starts a tiny drafter and a tiny verifier on each transport (separate processes,
as `specdec up` runs them), then times, interleaved so both see the same machine:
  - a round's two RPCs with no model work (two Info calls): the transport's cost;
  - a whole round (Propose γ=4 with its commit, then Verify), greedy and at T=0.7
    (at T=0.7 the draft probabilities travel: [4, 512] fp16).
Prints a table and writes JSON (default rpc_time.json).

  python benchmarks/rpc_time.py [--rounds 300] [--out rpc_time.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from specdec_tools import launcher
from specdec.rpc.serving import channel
from specdec.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc

PROMPT = [57, 84, 275, 71, 261, 276, 371]


class Transport:
    def __init__(self, name: str, drafter_address: str, verifier_address: str):
        self.name = name
        self.channels = [channel(drafter_address), channel(verifier_address)]
        self.drafter = drafter_pb2_grpc.DrafterStub(self.channels[0])
        self.verifier = verifier_pb2_grpc.VerifierStub(self.channels[1])
        self.samples: dict[str, list[float]] = {"2 x Info (transport only)": [], "round, greedy": [],
                                                "round, T=0.7": []}
        self._session = 0

    def info_pair(self) -> None:
        started = time.perf_counter()
        self.drafter.Info(common_pb2.InfoRequest(), timeout=10)
        self.verifier.Info(common_pb2.InfoRequest(), timeout=10)
        self.samples["2 x Info (transport only)"].append((time.perf_counter() - started) * 1e3)

    def rounds(self, temperature: float, count: int) -> None:
        self._session += 1
        session_id = f"{self.name}-{self._session}"
        sampling = common_pb2.SamplingParams(temperature=temperature, seed=1 if temperature else None)
        start = common_pb2.StartSessionRequest(session_id=session_id, prompt_token_ids=PROMPT)
        self.drafter.StartSession(start, timeout=10)
        self.verifier.StartSession(start, timeout=10)
        key = "round, greedy" if temperature == 0 else "round, T=0.7"
        commit = None
        try:
            for _ in range(count):
                started = time.perf_counter()
                request = drafter_pb2.ProposeRequest(session_id=session_id, num_tokens=4, sampling=sampling)
                if commit is not None:
                    request.commit.CopyFrom(commit)
                draft = self.drafter.Propose(request, timeout=10)
                verdict = self.verifier.Verify(verifier_pb2.VerifyRequest(
                    session_id=session_id, draft_token_ids=draft.draft_token_ids,
                    draft_probs=draft.draft_probs, sampling=sampling), timeout=10)
                self.samples[key].append((time.perf_counter() - started) * 1e3)
                commit = drafter_pb2.Commit(num_accepted=verdict.num_accepted,
                                            target_token_ids=[verdict.next_token_id])
        finally:
            for stub in (self.drafter, self.verifier):
                stub.EndSession(common_pb2.EndSessionRequest(session_id=session_id), timeout=10)

    def close(self) -> None:
        for ch in self.channels:
            ch.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--out", default="rpc_time.json")
    args = parser.parse_args()
    sockets = launcher.SocketDir()
    children: list[launcher.Child] = []
    try:
        for name, listen in (("tcp-drafter", ["--host", "127.0.0.1", "--port", "0"]),
                             ("tcp-verifier", ["--host", "127.0.0.1", "--port", "0"]),
                             ("uds-drafter", ["--uds", sockets.socket("drafter")]),
                             ("uds-verifier", ["--uds", sockets.socket("verifier")])):
            module = name.split("-")[1]
            children.append(launcher.spawn(name, module, ["--model", f"tiny-{'draft' if module == 'drafter' else 'target'}",
                                                          "--threads", "1", *listen]))
        for child in children:
            launcher.wait_serving(child, 120)
        transports = [Transport("tcp", children[0].address, children[1].address),
                      Transport("uds", children[2].address, children[3].address)]
        for transport in transports:  # warm both
            transport.rounds(0.0, 20)
            for _ in range(20):
                transport.info_pair()
        for transport in transports:
            transport.samples = {k: [] for k in transport.samples}
        chunk = 25  # interleave the transports in chunks, so both see the same machine
        for _ in range(0, args.rounds, chunk):
            for transport in transports:
                for _ in range(chunk):
                    transport.info_pair()
                transport.rounds(0.0, chunk)
                transport.rounds(0.7, chunk)
        results = {t.name: {k: {"median_ms": statistics.median(v), "p90_ms": statistics.quantiles(v, n=10)[-1],
                                "n": len(v)} for k, v in t.samples.items()} for t in transports}
        print(f"{'per round':28s} {'TCP median':>11s} {'UDS median':>11s} {'UDS/TCP':>8s} {'TCP p90':>8s} {'UDS p90':>8s}")
        for key in transports[0].samples:
            tcp, uds = results["tcp"][key], results["uds"][key]
            print(f"{key:28s} {tcp['median_ms']:9.3f} ms {uds['median_ms']:9.3f} ms "
                  f"{uds['median_ms'] / tcp['median_ms']:8.2f} {tcp['p90_ms']:5.3f} ms {uds['p90_ms']:5.3f} ms")
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
        print(f"wrote {args.out}")
        for transport in transports:
            transport.close()
    finally:
        launcher.stop(children, grace_s=5)
        sockets.remove()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
