"""A draft and a target over one tokenizer whose embeddings pad the vocabulary to
different sizes (Qwen2.5's 0.5B pads to 151,936 rows, its 7B to 152,064): draft
and target probabilities are compared over the tokenizer's ids only (the padding
rows can never be sampled), so speculation stays lossless either way round."""
from __future__ import annotations

import collections
import copy
import concurrent.futures
import dataclasses

import pytest
import torch

import drafter.service
import verifier.service
from specdec.runtime import lean
from specdec.runtime.cost_curve import CostCurve
from specdec.runtime.models import LoadedModel
from specdec.spec.sampling import SamplingConfig
from specdec_tools.distribution import chi_square_p, exact_first_two_token_distribution, observed_outcome
from tests.conftest import CHEAP_DRAFT_MS, TARGET_MS, coordinator_stub
from tests.test_end_to_end import PROMPTS, generate


def padded(loaded: LoadedModel, extra_rows: int) -> LoadedModel:
    """The same model with `extra_rows` more embedding and LM-head rows (random, as a
    checkpoint's padding is): the tokenizer's ids keep their logits."""
    model = type(loaded.model)(copy.deepcopy(loaded.model.config))
    model.load_state_dict(loaded.model.state_dict())
    rows = loaded.model_vocab_size + extra_rows
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        model.resize_token_embeddings(rows, mean_resizing=False)
    model.eval()
    return dataclasses.replace(loaded, model=model, model_vocab_size=rows, lean=lean.LeanForward(model))


@pytest.fixture(scope="module", params=["target pads more", "draft pads more"])
def uneven(request, tiny_draft, tiny_target):
    draft, target = ((tiny_draft, padded(tiny_target, 128)) if request.param == "target pads more"
                     else (padded(tiny_draft, 128), tiny_target))
    assert draft.vocab_size == target.vocab_size and draft.model_vocab_size != target.model_vocab_size
    servers = [drafter.service.serve(draft, cost_curve=CostCurve(CHEAP_DRAFT_MS, 0.05)),
               verifier.service.serve(target, cost_curve=CostCurve(TARGET_MS, 1.0))]
    try:
        with coordinator_stub(drafter=f"127.0.0.1:{servers[0].port}", verifier=f"127.0.0.1:{servers[1].port}",
                              gamma=4, learn_costs=False) as stub:
            yield stub, target
    finally:
        for server in servers:
            server.stop(0)


def test_the_padding_changes_no_logit_of_the_tokenizers_ids(tiny_target):
    wider = padded(tiny_target, 128)
    ids = torch.tensor(tiny_target.tokenizer.encode("The weather today is sunny"))
    plain = tiny_target.lean(ids, tiny_target.lean.new_cache(), keep_last=3)
    more = wider.lean(ids, wider.lean.new_cache(), keep_last=3)
    assert more.shape[1] == plain.shape[1] + 128
    assert torch.equal(more[:, :tiny_target.vocab_size], plain[:, :tiny_target.vocab_size])


def test_greedy_speculative_output_is_target_only_whatever_each_side_pads(uneven):
    stub, _ = uneven
    drafted = 0
    for prompt in PROMPTS[:4]:
        spec = generate(stub, prompt, speculate=True, gamma=4)
        assert list(spec.token_ids) == list(generate(stub, prompt, speculate=False).token_ids), prompt
        drafted += spec.stats.draft_tokens
    assert drafted > 20


def test_sampled_tokens_follow_the_target_whatever_each_side_pads(uneven):
    stub, target = uneven
    sampling, runs, prompt = SamplingConfig(temperature=0.8, top_k=40), 1000, "Hello, world! How are"
    p1, joint = exact_first_two_token_distribution(target, target.tokenizer.encode(prompt), sampling)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        responses = list(pool.map(lambda seed: generate(stub, prompt, speculate=True, gamma=3, max_new_tokens=3,
                                                        temperature=0.8, top_k=40, seed=seed), range(runs)))
    first, pairs = collections.Counter(), collections.Counter()
    for r in responses:
        x1, pair = observed_outcome(r)
        first[x1] += 1
        pairs[pair] += 1
    assert all(t < target.vocab_size for r in responses for t in r.token_ids)  # never a padding row
    assert sum(r.stats.accepted_tokens for r in responses) > 0.2 * sum(r.stats.draft_tokens for r in responses)
    assert chi_square_p(first, p1, runs) > 1e-3
    assert chi_square_p(pairs, joint, runs) > 1e-3
