"""The real services on the check's models: a drafter and a verifier built with
random weights (--random-weights), a coordinator in front, every request
through Generate as a client sends it.

Random-weight models agree on nothing, so the verifier runs the benchmark
setting --synthetic-acceptance (drafts kept at a chosen rate): spec's speed is
then what a real pair of that acceptance gets from these services on this
device. One drafter serves every acceptance; the verifier and the coordinator
start again for each (the rate is a start setting of the verifier).

Per system (target-only; spec at fixed γ; spec-auto), greedy, `ignore_eos`:
decode ms per token (after the first token, which is the prefill's), the
acceptance and mean accepted length seen, the calls' cost a round as calls
(the stats' rpc_ms: their time at the coordinator less their time in the
services), and for fixed γ the time a round spends outside the two models'
forwards (the RPCs, the rejection sampler, the services' host work): the
round's client-side time less γ draft steps and one verification of γ + 1 rows
on the services' own synchronized curves.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from specdec.rpc.serving import channel
from specdec.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc, drafter_pb2_grpc, verifier_pb2_grpc
from specdec_tools import launcher
from specdec_tools.gpu.shapes import Model

GAMMAS = (1, 2, 4)
READY_S = 300.0


@dataclass
class Served:
    pair: str
    acceptance: float
    system: str
    prompts: int = 0
    tokens: int = 0
    ms_per_token: float = 0.0
    acceptance_seen: float = 0.0     # the first draft's acceptance over rounds
    mean_accepted_length: float = 0.0
    drafted_per_round: float = 0.0   # draft tokens a round: γ where fixed, the controller's choice where auto
    outside_ms_per_round: float | None = None   # fixed γ: the round's calls less the forwards on the curves
    rpc_ms_per_round: float | None = None       # the round's calls less their time in the services
    synthetic: float = 0.0           # the stats' mark: must equal `acceptance` for spec systems


@dataclass
class PairResult:
    pair: str
    draft_curve: list[float] = field(default_factory=list)    # the drafter's Info: ms by rows
    verify_curve: list[float] = field(default_factory=list)
    # The same after the runs: kept current from the forwards served (on a GPU, CUDA events' time)
    draft_curve_after: list[float] = field(default_factory=list)
    verify_curve_after: list[float] = field(default_factory=list)
    runs: list[Served] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


def _request(prompt: str, system: str, max_new_tokens: int) -> coordinator_pb2.GenerateRequest:
    request = coordinator_pb2.GenerateRequest(prompt=prompt, max_new_tokens=max_new_tokens, ignore_eos=True,
                                              sampling=common_pb2.SamplingParams(temperature=0.0))
    request.speculation.enabled = system != "target-only"
    if system.startswith("γ="):
        request.speculation.gamma = int(system[2:])
        request.speculation.proposer = coordinator_pb2.PROPOSER_KIND_MODEL
    elif system == "auto":
        request.speculation.proposer = coordinator_pb2.PROPOSER_KIND_MODEL
    return request


def _run(stub, result: PairResult, acceptance: float, system: str, prompts: list[str],
         max_new_tokens: int) -> Served:
    served = Served(result.pair, acceptance, system, prompts=len(prompts))
    decode_ms = tokens = drafted = accepted = rounds = first_kept = 0.0
    outside, outside_rounds, rpc_ms = 0.0, 0, 0.0
    for prompt in prompts:
        response = stub.Generate(_request(prompt, system, max_new_tokens), timeout=600)
        stats = response.stats
        decode_ms += stats.total_ms - stats.first_token_ms  # the first token is the prefill's
        tokens += len(response.token_ids) - 1
        drafted += stats.draft_tokens
        accepted += stats.accepted_tokens
        rounds += stats.rounds
        rpc_ms += stats.rpc_ms
        first_kept += stats.rounds * (stats.acceptance_by_position[0] if stats.acceptance_by_position else 0.0)
        served.synthetic = stats.synthetic_acceptance
        if system.startswith("γ=") and stats.rounds and result.draft_curve and result.verify_curve:
            gamma = int(system[2:])
            forwards = gamma * result.draft_curve[0] + result.verify_curve[min(gamma, len(result.verify_curve) - 1)]
            outside += stats.draft_ms + stats.verify_ms - stats.rounds * forwards
            outside_rounds += stats.rounds
    served.tokens = int(tokens)
    served.ms_per_token = round(decode_ms / tokens, 3) if tokens else 0.0
    if drafted:
        # A draft's chance to be kept given the ones before it were, as the synthetic rate and
        # the bound's α mean it: the first draft's, over rounds (accepted / drafted is lower at γ > 1).
        served.acceptance_seen = round(first_kept / rounds, 3)
        served.mean_accepted_length = round((accepted + rounds) / rounds, 3) if rounds else 0.0
        served.drafted_per_round = round(drafted / rounds, 2) if rounds else 0.0
    if outside_rounds:
        served.outside_ms_per_round = round(outside / outside_rounds, 3)
    if rounds:
        served.rpc_ms_per_round = round(rpc_ms / rounds, 3)
    return served


def serve_pair(pair: str, draft: Model, target: Model, *, device: str, seed: int, draft_dtype: str,
               draft_quantize: str, head_vocab: int, target_dtype: str, forward: str, acceptances: list[float],
               prompts: list[str], max_new_tokens: int, deadline: float, on_run=lambda served: None) -> PairResult:
    """Every system at every acceptance on one pair, until `deadline` (time.monotonic)."""
    result = PairResult(pair)
    sockets = launcher.SocketDir()
    common = ["--device", device, "--random-weights", str(seed), "--forward", forward]
    children: list[launcher.Child] = []
    try:
        drafter = launcher.wait_serving(launcher.spawn("drafter", "drafter", [
            "--model", str(draft.path), "--dtype", draft_dtype, "--quantize", draft_quantize,
            "--head-vocab", str(head_vocab), "--uds", sockets.socket("drafter"), *common]), READY_S)
        children.append(drafter)
        result.draft_curve = _curve(drafter_pb2_grpc.DrafterStub, drafter.address)
        for i, acceptance in enumerate(acceptances):
            if time.monotonic() > deadline:
                result.skipped.append(f"acceptance {acceptance}: out of time")
                continue
            verifier = launcher.wait_serving(launcher.spawn("verifier", "verifier", [
                "--model", str(target.path), "--dtype", target_dtype, "--uds", sockets.socket(f"verifier{i}"),
                "--synthetic-acceptance", str(acceptance), *common]), READY_S)
            coordinator = launcher.wait_serving(launcher.spawn("coordinator", "coordinator", [
                "--drafter", drafter.address, "--verifier", verifier.address, "--port", "0", "--gamma", "auto"]),
                READY_S)
            try:
                result.verify_curve = _curve(verifier_pb2_grpc.VerifierStub, verifier.address)
                systems = (["target-only"] if i == 0 else []) + [f"γ={g}" for g in GAMMAS] + ["auto"]
                with channel(coordinator.address) as ch:
                    stub = coordinator_pb2_grpc.CoordinatorStub(ch)
                    _run(stub, result, acceptance, "target-only", prompts[:1], 8)  # warm the whole path
                    for system in systems:
                        if time.monotonic() > deadline:
                            result.skipped.append(f"{system} at acceptance {acceptance}: out of time")
                            continue
                        served = _run(stub, result, acceptance, system, prompts, max_new_tokens)
                        result.runs.append(served)
                        on_run(served)
                result.verify_curve_after = _curve(verifier_pb2_grpc.VerifierStub, verifier.address)
                result.draft_curve_after = _curve(drafter_pb2_grpc.DrafterStub, drafter.address)
            finally:
                launcher.stop([coordinator, verifier], grace_s=10)
    finally:
        launcher.stop(children, grace_s=10)
        sockets.remove()
    return result


def _curve(stub_cls, address: str) -> list[float]:
    with channel(address) as ch:
        return [round(ms, 3) for ms in stub_cls(ch).Info(common_pb2.InfoRequest(), timeout=30).forward_ms]
