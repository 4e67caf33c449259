"""One session of the target model: score a draft in one forward pass, run the
rejection sampler, roll the KV cache back to what was accepted."""
from __future__ import annotations

import dataclasses
import random
import secrets

import torch

from specdec.rpc.errors import FailedPrecondition, InvalidArgument
from specdec.runtime.device import HostCopy
from specdec.runtime.sequence import SequenceCache, Steps, drive
from specdec.runtime.kv_pool import KVPool
from specdec.runtime.models import LoadedModel
from specdec.spec.types import RejectionOutput
from specdec.spec.rejection import greedy_accept, rejection_sample, synthetic_num_accepted
from specdec.spec.sampling import SamplingConfig, generator_seed, position_uniforms
from specdec.spec.grammar import GrammarCursor
from specdec.spec.transform import grammar_allowed, sample_at, scores_to_probs, token_logprobs, transform_logits


class TargetSession:
    def __init__(self, loaded: LoadedModel, prompt_ids: list[int], pool: KVPool | None = None,
                 prefill: bool = True, chain: bool | None = None):
        self.loaded = loaded
        # Decoded tokens fed back on the device, read a step behind (None: as the device's policy says).
        self.chain = loaded.policy.chains_steps if chain is None else chain
        self.seq = SequenceCache(loaded, prompt_ids, pool)
        if prefill:  # else the caller runs seq.prefill_steps() (a service, through its scheduler)
            self.seq.prefill()
        # Sampling draws each position's token from uniforms keyed by the request's seed
        # and the position (sampling.position_uniforms): no state a round moves, so a
        # failed call leaves none behind. The benchmark's synthetic verdicts draw from
        # a generator on the host: a verdict on the device would cost a Verify a read
        # of its own beside its token's (on a GPU, a wait for every kernel queued).
        self.seed: int | None = None
        self.synthetic: random.Random | None = None
        # Structured output: the grammar every row is masked with (specdec.spec.grammar);
        # it follows the sequence's tokens, so a rollback or a restore needs nothing of it.
        self.grammar: GrammarCursor | None = None

    def snapshot(self) -> tuple:
        return self.seq.snapshot(), None if self.synthetic is None else self.synthetic.getstate()

    def restore(self, state: tuple) -> None:
        """Undo a call that failed: the session is exactly as it was before it."""
        tokens, rng = state
        self.seq.restore(tokens)
        if rng is None:
            self.synthetic = None
        else:
            self.synthetic.setstate(rng)

    def _seed(self, sampling: SamplingConfig) -> int:
        """The request's seed, or one drawn for the session when it has none."""
        if self.seed is None:
            self.seed = sampling.seed if sampling.seed is not None else secrets.randbits(64)
        return self.seed

    def _synthetic(self, sampling: SamplingConfig) -> random.Random:
        if self.synthetic is None:
            self.synthetic = random.Random(generator_seed(self._seed(sampling), "verifier"))
        return self.synthetic

    def _uniforms(self, sampling: SamplingConfig, start: int, count: int) -> torch.Tensor:
        """[count, 2] float64: the uniforms of positions start.. (of the session's seed)."""
        seed = self._seed(sampling)
        return torch.tensor([position_uniforms(seed, start + i) for i in range(count)], dtype=torch.float64)

    def _allowed(self, sampling: SamplingConfig, row_tokens: list[int], rows: int) -> torch.Tensor | None:
        """[rows, vocab] the grammar's masks after the sequence and each row token before
        the row (None: no constraint). Checked before anything changes."""
        if self.grammar is None:
            if sampling.constraint:
                raise FailedPrecondition("the call samples under a constraint, but its session was started "
                                         "without one")
            return None
        self.grammar.check(sampling.constraint)
        self.grammar.follow(self.seq.tokens)
        if rows == 0:
            return None
        return grammar_allowed(self.grammar.row_masks(row_tokens, rows), self.loaded.vocab_size)

    def _check_room(self, new_tokens: int) -> None:
        if len(self.seq) + new_tokens > self.loaded.max_context:
            raise InvalidArgument(
                f"{new_tokens} more tokens at position {len(self.seq)} exceed the target's context window "
                f"({self.loaded.max_context})")

    def verify(self, draft_token_ids: list[int], draft_probs: torch.Tensor | None,
               sampling: SamplingConfig) -> RejectionOutput:
        return drive(self.verify_steps(draft_token_ids, draft_probs, sampling))

    def verify_steps(self, draft_token_ids: list[int], draft_probs: torch.Tensor | None,
                     sampling: SamplingConfig, synthetic_acceptance: float = 0.0,
                     logprobs: int | None = None) -> Steps[RejectionOutput]:
        """`synthetic_acceptance` > 0: the benchmark setting (not lossless) that keeps each
        draft at that rate whatever the models say (rejection.synthetic_num_accepted).
        `logprobs` set: each output token's logprob and that many top ones (`token_logprobs`)."""
        gamma = len(draft_token_ids)
        self._check_room(gamma + 1)
        base = len(self.seq)
        # The grammar's mask of each row: row i after draft i - 1 (a forbidden draft ends them).
        allowed = self._allowed(sampling, draft_token_ids, gamma + 1)
        # 1. Score: one forward over the uncached token(s) and the draft.
        logits = yield from self.seq.step(draft_token_ids, keep_last=gamma + 1)         # [gamma+1, model_vocab]
        # 2. The same transform as the drafter, row i seeing the history up to draft i.
        scores = transform_logits(logits, self.seq.tokens[:base], draft_token_ids, sampling,
                                  self.loaded.vocab_size, allowed)                      # [gamma+1, vocab]
        draft = torch.tensor(draft_token_ids, dtype=torch.long)                          # [gamma] on the host
        # 3. Accept / reject.
        if synthetic_acceptance:
            accepted = synthetic_num_accepted(gamma, synthetic_acceptance, self._synthetic(sampling))
            row = scores[accepted:accepted + 1]
            token = int(row.argmax()) if sampling.greedy else int(sample_at(
                scores_to_probs(row), self._uniforms(sampling, base + accepted, 1)[:, 0])[0])
            out = RejectionOutput(accepted, token, bonus=accepted == gamma)
        elif sampling.greedy:
            out = greedy_accept(draft, scores.argmax(dim=-1))
        else:
            assert draft_probs is not None
            out = rejection_sample(draft, draft_probs.to(scores.device), scores_to_probs(scores),
                                   self._uniforms(sampling, base, gamma + 1))
        if logprobs is not None:   # rows 0..accepted drew the output tokens: no forward more
            out = dataclasses.replace(out, logprobs=tuple(token_logprobs(
                scores[:out.num_accepted + 1], out.output_token_ids(draft_token_ids), logprobs)))
        # 4. Roll back to the accepted prefix; the recovered/bonus token is fed next round.
        self.seq.truncate(base + out.num_accepted)
        self.seq.append([out.next_token_id])
        return out

    def decode(self, num_tokens: int, sampling: SamplingConfig) -> list[int]:
        return drive(self.decode_steps(num_tokens, sampling))

    def decode_steps(self, num_tokens: int, sampling: SamplingConfig, logprobs: int | None = None,
                     logprobs_out: list | None = None) -> Steps[list[int]]:
        """Plain target-only decoding, a Forward step a token; stops after an EOS token.
        `logprobs` set: each token's `token_logprobs` row is appended to `logprobs_out`."""
        self._check_room(num_tokens)
        self._allowed(sampling, [], 0)   # the constraint checked before anything changes
        if self.chain and not sampling.penalized and logprobs is None and self.grammar is None:
            return (yield from self._chained_decode(num_tokens, sampling))
        out: list[int] = []
        for _ in range(num_tokens):
            logits = yield from self.seq.step([], keep_last=1)
            scores = transform_logits(logits, self.seq.tokens, [], sampling, self.loaded.vocab_size,
                                      self._allowed(sampling, [], 1))
            if sampling.greedy:
                token = int(scores[0].argmax())
            else:
                token = int(sample_at(scores_to_probs(scores), self._uniforms(sampling, len(self.seq), 1)[:, 0])[0])
            if logprobs is not None:
                logprobs_out.extend(token_logprobs(scores, [token], logprobs))
            self.seq.append([token])
            out.append(token)
            if token in self.loaded.eos_token_ids:
                break
        return out

    def _chained_decode(self, num_tokens: int, sampling: SamplingConfig) -> Steps[list[int]]:
        """decode_steps with each token fed back from the device (its scores need no history: no
        penalty) and read a step behind: the host queues step i before it waits for token i-1
        and checks it for an EOS, so the device runs a step while the host reads. An EOS then
        costs the step queued after it, whose cache entry is dropped: the session is left as
        the step-by-step loop leaves it, every token but the last fed."""
        if num_tokens == 0:
            return []
        start = len(self.seq)                       # the first new token's position
        uniforms = None if sampling.greedy else \
            self._uniforms(sampling, start, num_tokens)[:, 0].to(self.loaded.device)
        copies: list[HostCopy] = []
        out: list[int] = []
        token = None                                # [1] on the device: the last step's
        for i in range(num_tokens):
            logits = yield from (self.seq.step_on_device(token, keep_last=1) if i
                                 else self.seq.step([], keep_last=1))
            scores = transform_logits(logits, self.seq.tokens, [], sampling, self.loaded.vocab_size)
            token = scores.argmax(dim=-1) if sampling.greedy else \
                sample_at(scores_to_probs(scores), uniforms[i:i + 1])       # [1] on the device
            copies.append(HostCopy(token))
            if i:                                   # the token before, read while this step runs
                out.extend(copies[i - 1].tolist())
                if out[-1] in self.loaded.eos_token_ids:
                    break
        else:
            out.extend(copies[-1].tolist())
        self.seq.settle(start, out)                 # after an EOS: its step's cache entry dropped
        return out
