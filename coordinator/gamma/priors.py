"""What requests learned, shared across requests per sampling regime: a new
request's controller starts from a copy (`GammaPriors.start`), and its state is
blended back when it ends (`finish`)."""
from __future__ import annotations

import copy
import threading

from specdec.spec.sampling import SamplingConfig

from coordinator.gamma.acceptance import Acceptance, Calibration
from coordinator.gamma.cost import LOAD_ALONE, CostModel
from coordinator.gamma.lengths import OutputLengths
from coordinator.gamma.policy import ControllerState

# One in this many requests refused the draft model for its prefill's cost drafts all the
# same (GammaPriors.probe_prefill), if its prompt is short enough to cost the drafter
# little (a few hundred ms at the 0.5B's 1-2 ms a token): so a draft cost measured high
# once is measured again within a few requests, at the price of a short prefill.
PREFILL_PROBE_EVERY = 4
PREFILL_PROBE_MAX_TOKENS = 256


def regime(sampling: SamplingConfig) -> str:
    """Acceptance depends on the sampling config: greedy, or a temperature bucket."""
    if sampling.greedy:
        return "greedy"
    return f"T{min(round(sampling.temperature * 4) / 4, 2.0):.2f}"


class GammaPriors:
    """What requests learned, shared across requests: one state per regime (the
    cost model is shared by all). A new request starts from a copy; when it ends
    its state is blended back in."""

    def __init__(self, blend: float = 0.5, prior_weight: float = 5.0, cost: CostModel | None = None):
        self.blend, self.prior_weight = blend, prior_weight
        self.lock = threading.Lock()
        self.acceptance: dict[str, Acceptance] = {}
        self.calibration: dict[str, Calibration] = {}
        self.lookup: dict[str, dict[str, list[Acceptance]]] = {}   # [regime][free source][match bucket]
        self.lookup_yield: dict[str, dict[str, float]] = {}        # [regime][free source]
        self.cost = cost or CostModel()
        self.rounds = 0
        self.curves: dict[str, object] = {}   # the services' latest published curves (follow)
        self.prefill_refusals = 0             # requests since the last the model drafted anyway
        self.lengths = OutputLengths()        # what finished requests generated, every regime's

    def probe_prefill(self, calls: float, prompt_tokens: int) -> bool:
        """For a request whose drafter prefill was not expected to pay: whether it
        drafts with the model all the same, one in PREFILL_PROBE_EVERY such requests
        made alone (never under load, where skipping the drafter spares the others)
        with at most PREFILL_PROBE_MAX_TOKENS to prefill.
        What refused it (the drafter's published curve, its prefill's cost) learns
        only from requests that draft: a curve measured high once (a warm-up beside
        a busy neighbour, or on a slow start) would otherwise keep the draft model
        off for the service's life."""
        if calls > LOAD_ALONE or prompt_tokens > PREFILL_PROBE_MAX_TOKENS:
            return False
        with self.lock:
            self.prefill_refusals += 1
            if self.prefill_refusals < PREFILL_PROBE_EVERY:
                return False
            self.prefill_refusals = 0
            return True

    def follow(self, **curves) -> None:
        """The services' newest curves (CostModel.follow's arguments): new requests
        plan on them, and a request that ends does not put an older one back."""
        with self.lock:
            self.curves.update({k: v for k, v in curves.items() if v})
            self.cost.follow(**curves)

    def start(self, sampling: SamplingConfig) -> ControllerState:
        with self.lock:
            key = regime(sampling)
            acceptance = copy.deepcopy(self.acceptance.get(key, Acceptance())).capped(self.prior_weight)
            calibration = copy.deepcopy(self.calibration.get(key, Calibration()))
            lookup = {source: [a.capped(self.prior_weight) for a in copy.deepcopy(buckets)]
                      for source, buckets in self.lookup.get(key, {}).items()}
            reach = copy.deepcopy(self.acceptance.get(key, Acceptance()))   # all of the regime's evidence
            return ControllerState(acceptance, copy.deepcopy(self.cost), calibration, self.rounds, lookup,
                                   dict(self.lookup_yield.get(key, {})), reach)

    def finish(self, sampling: SamplingConfig, state: ControllerState) -> None:
        with self.lock:
            key = regime(sampling)
            if key not in self.acceptance:
                self.acceptance[key] = copy.deepcopy(state.acceptance)
            else:
                _blend_acceptance(self.acceptance[key], state.acceptance, self.blend)
            if key not in self.calibration:
                self.calibration[key] = copy.deepcopy(state.calibration)
            else:
                prior, new = self.calibration[key], state.calibration
                _blend_into(prior.rates, prior.counts, new.rates, new.counts, self.blend)
            lookup, yields = self.lookup.setdefault(key, {}), self.lookup_yield.setdefault(key, {})
            for source, buckets in state.lookup.items():
                if source not in lookup:
                    lookup[source] = copy.deepcopy(buckets)
                else:
                    for prior, new in zip(lookup[source], buckets):
                        _blend_acceptance(prior, new, self.blend)
            for source, new_yield in state.lookup_yield.items():
                prior_yield = yields.get(source, new_yield)
                yields[source] = prior_yield + self.blend * (new_yield - prior_yield)
            self.cost = copy.deepcopy(state.cost)  # timings are shared by every regime
            self.cost.follow(**self.curves)
            self.rounds = max(self.rounds, state.rounds)


def _blend_acceptance(prior: Acceptance, new: Acceptance, blend: float) -> None:
    prior.alpha += blend * (new.alpha - prior.alpha)
    prior.count = max(prior.count, new.count)
    _blend_into(prior.by_position, prior.count_by_position, new.by_position, new.count_by_position, blend)


def _blend_into(values: list[float], counts: list[float], new_values: list[float], new_counts: list[float],
                blend: float) -> None:
    """Move each prior EWMA `blend` of the way to a request's, keeping the larger
    evidence count; entries only the request has are taken as they are."""
    for i, value in enumerate(new_values):
        if i < len(values):
            values[i] += blend * (value - values[i])
            counts[i] = max(counts[i], new_counts[i])
        else:
            values.append(value)
            counts.append(new_counts[i])
