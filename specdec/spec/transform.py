"""The one transform both sides apply to logits, and drawing from its
probabilities: torch, on the model services only (see specdec.spec.sampling)."""
from __future__ import annotations

import secrets
from typing import Sequence

import torch
from transformers.generation.logits_process import (LogitsProcessorList, RepetitionPenaltyLogitsProcessor,
                                                    TopKLogitsWarper, TopPLogitsWarper)

from specdec.spec.sampling import SamplingConfig, generator_seed


def make_generator(config: SamplingConfig, role: str, device: torch.device | str = "cpu") -> torch.Generator:
    seed = config.seed if config.seed is not None else secrets.randbits(64)
    generator = torch.Generator(device=device)
    generator.manual_seed(generator_seed(seed, role))
    return generator


def _truncation(config: SamplingConfig) -> LogitsProcessorList:
    # Same order as transformers' generate(): the penalty, the temperature, then these.
    steps = LogitsProcessorList()
    if config.top_k > 0:
        steps.append(TopKLogitsWarper(config.top_k))
    if config.top_p < 1.0:
        steps.append(TopPLogitsWarper(config.top_p))
    return steps


def transform_logits(
    logits: torch.Tensor,             # [N, model_vocab] raw logits, row i scores position i
    history: Sequence[int],           # token ids before row 0 (prompt + generated)
    row_tokens: Sequence[int],        # [N-1 or N] token at each row (row i+1 sees row_tokens[:i+1])
    config: SamplingConfig,
    vocab_size: int,                  # tokenizer vocabulary; padded ids beyond it are masked
    allowed: torch.Tensor | None = None,  # [N, vocab_size] bool: the grammar's masks (`grammar_allowed`)
) -> torch.Tensor:                    # [N, vocab_size] float32 scores (-inf where removed)
    n = logits.shape[0]
    assert logits.dim() == 2 and len(row_tokens) >= n - 1, (logits.shape, len(row_tokens))
    scores = logits[:, :vocab_size].float()
    if allowed is not None:
        # First, as vLLM applies its grammar bitmask: the penalties, the temperature and
        # top-k/top-p then see only what the grammar allows (top-p could otherwise keep
        # nothing the grammar allows).
        scores = scores.masked_fill(~allowed.to(scores.device), float("-inf"))
    if not config.penalized and config.greedy:
        return scores
    penalty = config.repetition_penalty != 1.0
    if penalty:
        # A penalty below 1 divides the seen tokens' positive logits by it, which
        # overflows float32 for a small one: those rows run in float64, where it
        # stays finite down to 2^-126 (validate()'s bound).
        if config.repetition_penalty < 1.0:
            scores = scores.double()
        # Row i penalizes the history and the row tokens before it; the processor
        # returns new rows (it scatters out of place), so the caller's logits stay as they were.
        apply = RepetitionPenaltyLogitsProcessor(config.repetition_penalty)
        prefix, rows = list(history), []
        for i in range(n):
            rows.append(apply(torch.tensor([prefix], dtype=torch.long, device=scores.device), scores[i : i + 1]))
            if i < len(row_tokens):
                prefix.append(int(row_tokens[i]))
        scores = torch.cat(rows)
    if config.additive_penalties:
        scores = _additive_penalties(scores, history, row_tokens, config)
    if not config.greedy:
        # Each row's maximum subtracted before the temperature divides: a temperature
        # down to 2^-126 then gives the greedy limit (0 at the maximum, -inf or far
        # below it elsewhere) instead of inf - inf = NaN. The subtraction makes the
        # copy the division (TemperatureLogitsWarper's) then runs in place on.
        scores = scores - scores.amax(dim=-1, keepdim=True)
        if config.temperature != 1.0:
            scores.div_(config.temperature)
        truncation = _truncation(config)
        if truncation:
            scores = truncation(torch.empty((n, 0), dtype=torch.long, device=scores.device), scores)
    return scores.float()


_BITS = torch.arange(32, dtype=torch.int32)


def grammar_allowed(masks, vocab_size: int) -> torch.Tensor:
    """[N] llguidance bitmasks (bytes; None: a row the grammar leaves free) -> [N, vocab_size]
    bool, True where the token is allowed."""
    rows = []
    for mask in masks:
        if mask is None:
            rows.append(torch.ones(vocab_size, dtype=torch.bool))
            continue
        words = torch.frombuffer(bytearray(mask), dtype=torch.int32)
        bits = ((words[:, None] >> _BITS) & 1).flatten().bool()
        rows.append(bits[:vocab_size] if bits.numel() >= vocab_size else
                    torch.cat([bits, torch.zeros(vocab_size - bits.numel(), dtype=torch.bool)]))
    return torch.stack(rows)


def _additive_penalties(scores: torch.Tensor, history: Sequence[int], row_tokens: Sequence[int],
                        config: SamplingConfig) -> torch.Tensor:
    """OpenAI's frequency and presence penalties (vLLM's order: after the repetition
    penalty, before the temperature): row i counts the output tokens before it, those
    of `history` from `config.penalty_start` on and the row tokens before row i."""
    n, vocab = scores.shape
    counts = torch.zeros(vocab, dtype=scores.dtype, device=scores.device)
    output = [t for t in list(history)[config.penalty_start:] if t < vocab]
    if output:
        counts += torch.bincount(torch.tensor(output, device=scores.device), minlength=vocab)[:vocab].to(scores.dtype)
    rows = []
    for i in range(n):
        rows.append(scores[i] - config.frequency_penalty * counts - config.presence_penalty * (counts > 0).to(scores.dtype))
        if i < len(row_tokens) and int(row_tokens[i]) < vocab:
            counts[int(row_tokens[i])] += 1
    return torch.stack(rows)


def scores_to_probs(scores: torch.Tensor) -> torch.Tensor:
    """[N, V] transformed scores -> [N, V] float32 probabilities."""
    return torch.softmax(scores, dim=-1)


def sample_from(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One id drawn from `probs` [V] (non-negative, positive total, not necessarily
    normalized) with one uniform from `generator`: `sample_at`.

    torch.multinomial took 2.4 ms a draw over Qwen's 151,936 ids here, an eighth of
    a draft step; this takes a tenth of that."""
    assert probs.dim() == 1, probs.shape
    # Whatever device `probs` is on (a sparse entry's: the CPU).
    return int(sample_at(probs[None], uniform(generator).reshape(1).to(probs.device))[0])


def uniform(generator: torch.Generator) -> torch.Tensor:
    """One float64 uniform in [0, 1), a scalar drawn where the generator lives (a CUDA
    generator draws only on its device): nothing is read back."""
    return torch.rand((), generator=generator, device=generator.device, dtype=torch.float64)


def sample_at(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse transform sampling, row by row: [N, V] probabilities (non-negative,
    positive totals, not necessarily normalized) and [N] float64 uniforms in [0, 1)
    -> [N] ids, each the first id whose running sum exceeds its uniform times the
    row's total. The running sums are float64, so every id's share of a row is
    exact to ~1e-16, far below the fp16 rounding the proposal carries; a row's id
    depends on that row and its uniform alone, whichever rows share the call."""
    assert probs.dim() == 2 and uniforms.shape == probs.shape[:1], (probs.shape, uniforms.shape)
    cumulative = probs.double().cumsum(-1)                                      # [N, V]
    points = uniforms.to(device=cumulative.device, dtype=torch.float64) * cumulative[:, -1]
    # Ids of zero probability add nothing to the sum, so they are never drawn.
    ids = torch.searchsorted(cumulative, points[:, None], right=True)[:, 0]
    # point == total, reachable only by rounding: the id where the running sum reaches the total
    # (the last of positive probability). Found for every row, a search, rather than asked
    # whether any row needs it: asking reads a value back to the host, which on a GPU waits
    # for all the work queued before it.
    last = torch.searchsorted(cumulative, cumulative[:, -1:].contiguous())[:, 0]
    return torch.where(ids >= probs.shape[1], last, ids)


LOGPROB_FLOOR = -9999.0  # a token the transform removed: OpenAI's API writes this, not -inf


def token_logprobs(scores: torch.Tensor, token_ids: Sequence[int], top: int) -> list[tuple]:
    """[N, V] transformed scores (row i: the distribution token i was drawn from) ->
    per row (token id, its log-probability, ((id, logprob) of the `top` most likely,
    most likely first)). Greedy scores carry the penalties alone: their softmax is the
    distribution at temperature 1, which is what a greedy request's logprobs report."""
    logprobs = torch.log_softmax(scores.float(), dim=-1).clamp(min=LOGPROB_FLOOR)        # [N, V]
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=scores.device)
    chosen = logprobs.gather(1, ids[:, None])[:, 0].tolist()
    best = logprobs.topk(top, dim=-1) if top else None
    out = []
    for i, token in enumerate(token_ids):
        pairs = () if best is None else tuple(zip(best.indices[i].tolist(), best.values[i].tolist()))
        out.append((int(token), chosen[i], pairs))
    return out
