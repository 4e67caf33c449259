"""The one sampling config, validated, and the seeds it derives: no torch, so the
coordinator can hold it.

The proposer and the scorer must turn logits into probabilities identically
(same temperature, top-k, top-p and penalties over the same history),
or the rejection sampler's output is no longer the target's distribution. So
there is exactly one transform of this config (specdec.spec.transform), and
both model services apply it.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

from specdec.rpc.errors import InvalidArgument

MAX_TOP_K = 1 << 20
# The smallest temperature and repetition penalty taken: the smallest normal
# float32 (the wire's type). Below it a float32 loses precision (subnormals).
MIN_SCALE = 2.0 ** -126
MAX_ADDITIVE_PENALTY = 2.0  # frequency and presence penalties: OpenAI's range


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0          # 0 = greedy
    top_k: int = 0                    # 0 = off
    top_p: float = 1.0                # 1 = off
    repetition_penalty: float = 1.0   # 1 = off
    seed: int | None = None
    frequency_penalty: float = 0.0    # 0 = off; OpenAI's, over the tokens from penalty_start on
    presence_penalty: float = 0.0     # 0 = off
    penalty_start: int = 0            # the output's first position (the prompt's length)
    constraint: str = ""              # the fingerprint of the grammar sampled under ("": none; grammar.py)

    @property
    def additive_penalties(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def penalized(self) -> bool:
        """Whether a position's scores depend on the tokens before it (any penalty)."""
        return self.repetition_penalty != 1.0 or self.additive_penalties

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> "SamplingConfig":
        """Raise InvalidArgument with a message a person can act on."""
        t, p, k, r = self.temperature, self.top_p, self.top_k, self.repetition_penalty
        if not math.isfinite(t) or t < 0:
            raise InvalidArgument(f"temperature must be a finite number >= 0 (0 = greedy), got {t}", "temperature")
        if 0 < t < MIN_SCALE:
            raise InvalidArgument(f"temperature {t:g} is below the smallest one taken ({MIN_SCALE:.4g}, the smallest "
                                  "normal float32); send 0 for greedy decoding", "temperature")
        if not math.isfinite(p) or not 0.0 < p <= 1.0:
            raise InvalidArgument(f"top_p must be in (0, 1], got {p}", "top_p")
        if k < 0 or k > MAX_TOP_K:
            raise InvalidArgument(f"top_k must be between 0 (off) and {MAX_TOP_K}, got {k}", "top_k")
        if not math.isfinite(r) or r <= 0:
            raise InvalidArgument(f"repetition_penalty must be a finite number > 0 (1 = off), got {r}", "repetition_penalty")
        if r < MIN_SCALE:
            raise InvalidArgument(f"repetition_penalty {r:g} is below the smallest one taken ({MIN_SCALE:.4g}, the "
                                  "smallest normal float32)", "repetition_penalty")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not math.isfinite(value) or not -MAX_ADDITIVE_PENALTY <= value <= MAX_ADDITIVE_PENALTY:
                raise InvalidArgument(f"{name} must be in [-{MAX_ADDITIVE_PENALTY:g}, {MAX_ADDITIVE_PENALTY:g}] "
                                      f"(0 = off), got {value}", name)
        if self.penalty_start < 0:
            raise InvalidArgument(f"penalty_start must be >= 0, got {self.penalty_start}")
        if len(self.constraint) > 64 or not all(c in "0123456789abcdef" for c in self.constraint):
            raise InvalidArgument("constraint_fingerprint is the coordinator's: a grammar's hex fingerprint",
                                  "constraint_fingerprint")
        return self


ROLES = ("drafter", "verifier")  # one random stream each, derived from the one request seed


def generator_seed(seed: int, role: str) -> int:
    """The generator seed of `role` for a request seed: a hash of all 64 bits of
    the seed and the role. torch's CPU generator (mt19937) keeps only the low 32
    bits of its seed, so seeds that differ above bit 31 must differ there too."""
    assert role in ROLES, role
    digest = hashlib.blake2b(f"specdec:{role}:{seed}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def position_uniforms(seed: int, position: int) -> tuple[float, float]:
    """The verifier's two uniforms in [0, 1) for the token at `position` (its index
    in the session's sequence, prompt included) of a request whose seed is `seed`:
    a hash of both, so they do not depend on how the request's tokens were split
    into rounds. Target-only decoding draws a position's token from the first; a
    speculative round draws a lookup token's verdict from the same one (the
    rejection sampler), so a seeded request whose drafts are all lookups samples
    target-only's tokens exactly. The second draws a rejected model draft's
    recovered token. 53 bits each: a float64's mantissa."""
    digest = hashlib.blake2b(f"specdec:verifier:{seed}:{position}".encode(), digest_size=16).digest()
    return (int.from_bytes(digest[:8], "little") >> 11) / 2.0 ** 53, \
        (int.from_bytes(digest[8:], "little") >> 11) / 2.0 ** 53
