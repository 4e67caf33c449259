"""The exact distribution of a target's first two sampled tokens, and a chi-square
test of observed generations against it: how the test suite and
scripts/gpu_check.py prove that sampled speculative output is the target's own."""
from __future__ import annotations

import collections

import torch

from specdec.spec.sampling import SamplingConfig
from specdec.spec.transform import grammar_allowed, scores_to_probs, transform_logits
from specdec.v1 import coordinator_pb2 as pb


def exact_first_two_token_distribution(loaded, prompt_ids: list[int], sampling: SamplingConfig,
                                       grammar=None) -> tuple[dict, dict]:
    """P(x1) and P(x1, x2) of target-only sampling, from the target model itself;
    under a structured output's grammar (a GrammarCursor from the prompt's end) if given."""
    def allowed(tokens: list[int]):
        if grammar is None:
            return None
        grammar.follow(tokens)
        return grammar_allowed(grammar.row_masks([], 1), loaded.vocab_size)

    with torch.inference_mode():
        logits = loaded.model(input_ids=torch.tensor([prompt_ids], device=loaded.device)).logits[0, -1:]
        p1 = scores_to_probs(transform_logits(logits, prompt_ids, [], sampling, loaded.vocab_size,
                                              allowed(prompt_ids)))[0]
        support = p1.nonzero()[:, 0].tolist()
        batch = torch.tensor([prompt_ids + [x] for x in support], device=loaded.device)
        logits2 = loaded.model(input_ids=batch).logits[:, -1]
        p2 = torch.stack([scores_to_probs(transform_logits(logits2[i : i + 1], prompt_ids + [x], [], sampling,
                                                           loaded.vocab_size, allowed(prompt_ids + [x])))[0]
                          for i, x in enumerate(support)])
    # EOS ends a generation and is not returned, so all EOS ids are one outcome.
    eos = set(loaded.eos_token_ids)
    label = lambda t: "EOS" if t in eos else t  # noqa: E731
    first, joint = collections.defaultdict(float), collections.defaultdict(float)
    for i, x1 in enumerate(support):
        first[label(x1)] += float(p1[x1])
        if x1 in eos:
            joint[("EOS", None)] += float(p1[x1])
            continue
        for x2 in p2[i].nonzero()[:, 0].tolist():
            joint[(x1, label(x2))] += float(p1[x1] * p2[i, x2])
    return dict(first), dict(joint)


def observed_outcome(response) -> tuple:
    ids = list(response.token_ids)
    if not ids:
        return "EOS", ("EOS", None)
    if len(ids) == 1:
        assert response.finish_reason == pb.FINISH_REASON_EOS, response.finish_reason
        return ids[0], (ids[0], "EOS")
    return ids[0], (ids[0], ids[1])


def chi_square_p(counts: collections.Counter, expected_probs: dict, n: int, min_expected: float = 5.0) -> float:
    """Pearson chi-square; outcomes expected fewer than `min_expected` times share one bin."""
    big = [k for k, p in expected_probs.items() if p * n >= min_expected]
    observed = [counts.get(k, 0) for k in big]
    expected = [expected_probs[k] * n for k in big]
    observed.append(n - sum(observed))
    expected.append(n - sum(expected))
    assert all(k in expected_probs for k in counts), "sampled an outcome the target gives probability 0"
    from scipy import stats  # the test extra: where it is missing, only this test needs it
    return stats.chisquare(observed, expected).pvalue
