"""One session of the draft model: apply the last round's commit, then draft."""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from specdec.rpc.errors import FailedPrecondition, InvalidArgument
from specdec.runtime.sequence import SequenceCache, Steps, drive
from specdec.runtime.kv_pool import KVPool
from specdec.runtime.models import LoadedModel
from specdec.spec.types import Commit
from specdec.spec.sampling import SamplingConfig
from specdec.spec.grammar import GrammarCursor
from specdec.spec.transform import grammar_allowed, make_generator, scores_to_probs, transform_logits, uniform
from specdec.spec.wire import DraftProbs, Truncation
from specdec.spec.draft_probs import Drawn, draw, read_drawn


class Draft(NamedTuple):
    token_ids: list[int]                # [n] drafted by the model (after any prefix)
    draft_probs: list[DraftProbs]       # [n] as sent, when sampling: what each token was drawn from; [] when greedy
    confidences: list[float]            # [n] the probability the draft gave each of its tokens


def greedy_on_device(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[V] scores -> the greedy draft token and the probability the model's own softmax
    gives it (greedy has no sampling distribution; this says how sure the draft is),
    both still on the device: scalars, the token int64."""
    row = scores.float()
    best, token = row.max(dim=-1)          # the first maximum, as argmax
    return token, torch.exp(best - torch.logsumexp(row, dim=-1))


def greedy_draft(scores: torch.Tensor) -> tuple[int, float]:
    """greedy_on_device, copied to the host together: one read a draft step (on a GPU
    each read waits for every kernel queued before it)."""
    token, confidence = greedy_on_device(scores)
    token_id, probability = torch.stack([token.double(), confidence.double()]).tolist()
    return int(token_id), probability


class DraftSession:
    def __init__(self, loaded: LoadedModel, prompt_ids: list[int], pool: KVPool | None = None,
                 prefill: bool = True, chain: bool | None = None):
        self.loaded = loaded
        # Greedy drafts fed back on the device, read once a round (None: as the device's policy says).
        self.chain = loaded.policy.chains_steps if chain is None else chain
        self.seq = SequenceCache(loaded, prompt_ids, pool)
        if prefill:  # else the caller runs seq.prefill_steps() (a service, through its scheduler)
            self.seq.prefill()
        self.round_base = len(self.seq)  # tokens before the last proposal
        self.round_drafted = 0           # tokens drafted in it, not yet committed
        self.generator: torch.Generator | None = None
        # Structured output: drafts are drawn under the verifier's masks (specdec.spec.grammar);
        # it follows the sequence's tokens, so commits and restores need nothing of it.
        self.grammar: GrammarCursor | None = None

    def snapshot(self) -> tuple:
        return (self.seq.snapshot(), self.round_base, self.round_drafted,
                None if self.generator is None else self.generator.get_state())

    def restore(self, state: tuple) -> None:
        """Undo a call that failed: the session is exactly as it was before it."""
        tokens, self.round_base, self.round_drafted, rng = state
        self.seq.restore(tokens)
        if rng is None:
            self.generator = None
        else:
            self.generator.set_state(rng)

    def length_after(self, commit: Commit | None) -> int:
        """The session's length once `commit` is applied; raises if it cannot be."""
        if commit is None:
            if self.round_drafted:
                raise FailedPrecondition(
                    "Propose needs the commit of the previous round (num_accepted, target_token_ids)")
            return len(self.seq)
        if commit.num_accepted > self.round_drafted:
            raise InvalidArgument(
                f"commit.num_accepted={commit.num_accepted} but only {self.round_drafted} tokens were drafted")
        return self.round_base + commit.num_accepted + len(commit.target_token_ids)

    def commit(self, commit: Commit | None) -> None:
        self.length_after(commit)  # checks it
        if commit is None:
            return
        # KV rollback: drop the rejected drafts. After a fully accepted round the
        # last draft was never fed, so it stays in `tokens` and is fed next forward.
        self.seq.truncate(self.round_base + commit.num_accepted)
        self.seq.append(commit.target_token_ids)
        self.round_base, self.round_drafted = len(self.seq), 0

    def check_room(self, length: int, num_tokens: int) -> None:
        if length + num_tokens > self.loaded.max_context:
            raise InvalidArgument(
                f"drafting {num_tokens} tokens at position {length} exceeds the draft model's "
                f"context window ({self.loaded.max_context})")

    def propose(self, num_tokens: int, sampling: SamplingConfig, min_confidence: float = 0.0,
                prefix: Sequence[int] = (), truncation: Truncation = Truncation()) -> Draft:
        return drive(self.propose_steps(num_tokens, sampling, min_confidence, prefix, truncation))

    def propose_steps(self, num_tokens: int, sampling: SamplingConfig, min_confidence: float = 0.0,
                      prefix: Sequence[int] = (), truncation: Truncation = Truncation()) -> Steps[Draft]:
        """Draft up to `num_tokens` tokens after `prefix`, one Forward step each.

        `prefix`: tokens another source proposed for this round (an n-gram
        lookup); they are the round's first drafts, fed with the first step.
        The probabilities returned are exactly those each token was sampled from
        (fp16-rounded, see specdec.spec.wire; truncated to the support `truncation`
        keeps), as the rejection sampler requires.
        Drafting stops after a token whose probability is below `min_confidence`:
        where the draft is unsure, the tokens after it are likely rejected. The
        rule only shortens the draft, so the verifier's output is unchanged."""
        self.check_room(len(self.seq), len(prefix) + num_tokens)
        self._check_constraint(sampling)
        if self.generator is None and not sampling.greedy:
            self.generator = make_generator(sampling, "drafter", self.loaded.device)
        self.round_base = len(self.seq)
        self.seq.append(prefix)
        if self.chain and not sampling.penalized and self.grammar is None:
            return (yield from self._chained(num_tokens, sampling, truncation, min_confidence, len(prefix)))
        draft_ids: list[int] = []
        entries: list[DraftProbs] = []
        confidences: list[float] = []
        for i in range(num_tokens):
            if self._grammar_ended(draft_ids[-1:]):
                break
            logits = yield from self.seq.step(draft_ids[-1:] if i else [], keep_last=1)  # [1, model_vocab]
            scores = transform_logits(logits, self.seq.tokens, [], sampling, self.loaded.vocab_size,
                                      self._allowed())
            if sampling.greedy:
                token, confidence = greedy_draft(scores[0])
            else:
                (token,), (confidence,), entry = read_drawn([self._draw(scores, truncation)])
                entries += entry
            draft_ids.append(token)
            confidences.append(confidence)
            if confidence < min_confidence:
                break
        # The last draft is not fed yet: next round feeds it only if it was accepted.
        self.seq.append(draft_ids[-1:])
        self.round_drafted = len(prefix) + len(draft_ids)
        return Draft(draft_ids, entries, confidences)

    def _check_constraint(self, sampling: SamplingConfig) -> None:
        if self.grammar is not None:
            self.grammar.check(sampling.constraint)
        elif sampling.constraint:
            raise FailedPrecondition("the call samples under a constraint, but its session was started without one")

    def _grammar_ended(self, pending: list[int]) -> bool:
        """Whether the grammar admits nothing more after the sequence and `pending` (the
        draft not fed yet): its end was drafted (an EOS), and the output ends there."""
        if self.grammar is None:
            return False
        self.grammar.follow([*self.seq.tokens, *pending])
        return self.grammar.stopped

    def _allowed(self) -> torch.Tensor | None:
        """[1, vocab] the grammar's mask after the sequence (None: no constraint)."""
        if self.grammar is None:
            return None
        self.grammar.follow(self.seq.tokens)
        return grammar_allowed([self.grammar.mask()], self.loaded.vocab_size)

    def _draw(self, scores: torch.Tensor, truncation: Truncation) -> Drawn:
        """A sampled draft token from [1, V] scores, with one uniform from the session's generator."""
        return draw(scores_to_probs(scores)[0], truncation, uniform(self.generator).to(scores.device))

    def _chained(self, num_tokens: int, sampling: SamplingConfig, truncation: Truncation, min_confidence: float,
                 prefix: int) -> Steps[Draft]:
        """Drafting with each token fed back from the device (its scores need no history: no
        penalty), greedy or sampled: the host queues a step without waiting for the last, and reads
        the round's tokens, confidences and support sizes once, then copies the proposals sent.
        Every step runs; the confidence rule then cuts the draft after the token it would have
        stopped at, the generator is set back to where that token's draw left it, and the session
        is left as the step-by-step loop leaves it: the kept drafts but the last fed, the last appended."""
        tokens: list[torch.Tensor] = []
        confidences: list[torch.Tensor] = []
        drawn: list[Drawn] = []
        states: list[torch.Tensor] = []                    # the generator after each draw
        for i in range(num_tokens):
            logits = yield from (self.seq.step_on_device(tokens[-1].view(1), keep_last=1) if i
                                 else self.seq.step([], keep_last=1))
            if sampling.greedy:
                token, confidence = greedy_on_device(logits[0, :self.loaded.vocab_size])
            else:
                drawn.append(self._draw(transform_logits(logits, (), (), sampling, self.loaded.vocab_size),
                                        truncation))
                token, confidence = drawn[-1].token, drawn[-1].confidence
                states.append(self.generator.get_state())  # host state (a CUDA generator's seed and offset)
            tokens.append(token)
            confidences.append(confidence)
        if not tokens:
            self.round_drafted = prefix
            return Draft([], [], [])
        if drawn:
            ids, sure, entries = read_drawn(drawn)
        else:
            ids, sure = torch.stack([torch.stack(tokens).double(), torch.stack(confidences).double()]).tolist()
            entries = []
        kept = next((i + 1 for i, p in enumerate(sure) if p < min_confidence), len(ids))
        ids = [int(t) for t in ids[:kept]]
        if states:
            self.generator.set_state(states[kept - 1])
        self.seq.settle(self.round_base + prefix, ids)    # the cut drafts' cache dropped
        self.round_drafted = prefix + kept
        return Draft(ids, entries[:kept], sure[:kept])
