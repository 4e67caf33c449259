#!/usr/bin/env python
"""A round's two calls through real drafter and verifier processes, as `specdec up`
runs them, against what the services' own forwards cost (their cost curves).

For each setting of the OpenMP workers' spin (`--spin`: "default" leaves
libgomp's own, any number sets GOMP_SPINCOUNT, "passive" sets
OMP_WAIT_POLICY=PASSIVE), it starts both services, then times rounds of
Propose(γ) + Verify at γ = 1 and 3, greedy and T=0.7, after a 128-token prompt;
every draft is rejected but for the verifier's own token, so each round runs at
the same length. Prints a table and writes JSON.

  python scripts/round_time.py --spin default,10000
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from specdec.rpc.serving import channel
from specdec_tools import launcher
from specdec.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc

SPIN_ENV = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")


def _environment(spin: str) -> dict[str, str]:
    if spin == "default":
        return {"GOMP_SPINCOUNT": "300000"}  # libgomp's own default, said explicitly (the services set 10000 otherwise)
    if spin == "passive":
        return {"OMP_WAIT_POLICY": "PASSIVE"}
    return {"GOMP_SPINCOUNT": str(int(spin))}


def measure(args, spin: str) -> dict:
    saved = {k: os.environ.pop(k, None) for k in SPIN_ENV}
    os.environ.update(_environment(spin))
    sockets = launcher.SocketDir()
    children = []
    try:
        children.append(launcher.wait_serving(launcher.spawn("drafter", "drafter", [
            "--model", args.draft, "--dtype", "fp32", "--quantize", "int8", "--uds", sockets.socket("drafter"),
            "--threads", str(args.threads), "--cost-curve-rows", "1"]), 900))
        children.append(launcher.wait_serving(launcher.spawn("verifier", "verifier", [
            "--model", args.target, "--dtype", "bf16", "--quantize", "int4", "--uds", sockets.socket("verifier"),
            "--threads", str(args.threads), "--cost-curve-rows", "4"]), 900))
        drafter = drafter_pb2_grpc.DrafterStub(channel(children[0].address))
        verifier = verifier_pb2_grpc.VerifierStub(channel(children[1].address))
        result = {"draft_curve_ms": list(drafter.Info(common_pb2.InfoRequest()).forward_ms),
                  "verify_curve_ms": list(verifier.Info(common_pb2.InfoRequest()).forward_ms), "rounds": {}}
        prompt = [(7 * i + 3) % 150_000 for i in range(128)]
        for gamma in (1, 3):
            for temperature in (0.0, 0.7):
                sid = f"g{gamma}-t{temperature}"
                start = common_pb2.StartSessionRequest(session_id=sid, prompt_token_ids=prompt)
                drafter.StartSession(start, timeout=60)
                verifier.StartSession(start, timeout=60)
                sampling = common_pb2.SamplingParams(temperature=temperature, seed=1)
                commit, propose_ms, verify_ms = None, [], []
                for _ in range(args.rounds):
                    request = drafter_pb2.ProposeRequest(session_id=sid, num_tokens=gamma, sampling=sampling)
                    if commit is not None:
                        request.commit.CopyFrom(commit)
                    started = time.perf_counter()
                    draft = drafter.Propose(request, timeout=60)
                    propose_ms.append((time.perf_counter() - started) * 1e3)
                    started = time.perf_counter()
                    verdict = verifier.Verify(verifier_pb2.VerifyRequest(
                        session_id=sid, draft_token_ids=draft.draft_token_ids,
                        draft_probs=draft.draft_probs, sampling=sampling), timeout=60)
                    verify_ms.append((time.perf_counter() - started) * 1e3)
                    commit = drafter_pb2.Commit(num_accepted=verdict.num_accepted,
                                                target_token_ids=[verdict.next_token_id])
                result["rounds"][sid] = {"propose_ms_per_token": statistics.median(propose_ms) / gamma,
                                         "verify_ms": statistics.median(verify_ms)}
        return result
    finally:
        launcher.stop(children)
        sockets.remove()
        for key, value in saved.items():
            os.environ.pop(key, None)
            if value is not None:
                os.environ[key] = value


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--spin", default="default,10000", help="comma-separated: default, passive, or a spin count")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="round_time.json")
    args = parser.parse_args()
    results = {spin: measure(args, spin) for spin in args.spin.split(",")}
    print(f"{'spin':>8} | {'round':>10} | propose ms/token | verify ms | draft step | verify curve (1..4 rows)")
    for spin, result in results.items():
        curve = ", ".join(f"{ms:.1f}" for ms in result["verify_curve_ms"])
        for sid, row in result["rounds"].items():
            print(f"{spin:>8} | {sid:>10} | {row['propose_ms_per_token']:16.1f} | {row['verify_ms']:9.1f} | "
                  f"{result['draft_curve_ms'][0]:10.1f} | {curve}")
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
