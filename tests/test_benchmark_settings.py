"""The benchmark-only settings the GPU check runs on: models built from a config
with random weights (--random-weights), and a verifier that accepts drafts at a
chosen rate (--synthetic-acceptance), off unless named and marked wherever on."""
from __future__ import annotations

import json

import pytest
import torch

import drafter.service
import verifier.service
from specdec.rpc.errors import InvalidArgument
from specdec.runtime.cost_curve import CostCurve
from specdec.runtime.models import load_model
from specdec.rpc.serving import channel
from specdec.v1 import common_pb2, verifier_pb2_grpc
from specdec.weights import tiny
from specdec.weights.synthetic import write_model_dir
from tests.conftest import CHEAP_DRAFT_MS, TARGET_MS, coordinator_stub
from tests.test_end_to_end import PROMPTS, generate


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory):
    """A Qwen2-shaped config over the tiny tokenizer: what the GPU check's small shapes are."""
    from transformers import Qwen2Config
    tokenizer = tmp_path_factory.mktemp("tokenizer")
    tiny.build_tokenizer().save_pretrained(tokenizer)
    config = Qwen2Config(vocab_size=528, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                         architectures=["Qwen2ForCausalLM"]).to_dict()
    return write_model_dir(tmp_path_factory.mktemp("model"), config, tokenizer)


def test_a_model_is_built_from_its_config_with_weights_drawn_from_the_seed(config_dir):
    one, again, other = (load_model(str(config_dir), random_weights=seed) for seed in (1, 1, 2))
    assert one.model_vocab_size == 528 and one.vocab_size == tiny.TOKENIZER_VOCAB and one.lean is not None
    weights = [m.model.model.layers[0].mlp.up_proj.weight for m in (one, again, other)]
    assert torch.equal(weights[0], weights[1]) and not torch.equal(weights[0], weights[2])
    assert json.loads((config_dir / "config.json").read_text())["num_hidden_layers"] == 2


def test_random_weights_need_a_config_directory(tmp_path):
    with pytest.raises(InvalidArgument, match="config.json"):
        load_model("tiny-target", random_weights=1)
    with pytest.raises(InvalidArgument):
        load_model(str(tmp_path), random_weights=1)  # no config.json there


def test_a_synthetic_verifier_accepts_at_its_rate_and_every_response_says_so(tiny_draft, tiny_target):
    # The tiny draft agrees with the target's greedy token about 0.7 of the time:
    # a verifier keeping drafts at 0.3 shows 0.3, not the models' agreement.
    rate = 0.3
    servers = [drafter.service.serve(tiny_draft, cost_curve=CostCurve(CHEAP_DRAFT_MS, 0.05)),
               verifier.service.serve(tiny_target, cost_curve=CostCurve(TARGET_MS, 1.0), synthetic_acceptance=rate)]
    try:
        with channel(f"127.0.0.1:{servers[1].port}") as ch:
            assert verifier_pb2_grpc.VerifierStub(ch).Info(common_pb2.InfoRequest()).synthetic_acceptance == \
                pytest.approx(rate)
        with coordinator_stub(drafter=f"127.0.0.1:{servers[0].port}", verifier=f"127.0.0.1:{servers[1].port}",
                              gamma=4, learn_costs=False) as stub:
            rounds = first_kept = 0.0
            for prompt in PROMPTS:
                spec = generate(stub, prompt, speculate=True, gamma=4, max_new_tokens=40)
                plain = generate(stub, prompt, speculate=False, max_new_tokens=40)
                # Target-only's too: this verifier's output is not to be taken for the target's.
                assert spec.stats.synthetic_acceptance == plain.stats.synthetic_acceptance == pytest.approx(rate)
                rounds += spec.stats.rounds
                first_kept += spec.stats.rounds * spec.stats.acceptance_by_position[0]
    finally:
        for server in servers:
            server.stop(0)
    assert rounds > 150
    # 5.4 standard deviations at 150 rounds (0.037): apart from the models' own 0.7 by twice that.
    assert abs(first_kept / rounds - rate) < 0.2, first_kept / rounds


def test_the_synthetic_rate_is_refused_outside_its_range(tiny_target):
    with pytest.raises(ValueError, match="synthetic-acceptance"):
        verifier.service.serve(tiny_target, synthetic_acceptance=1.5)


def test_a_lossless_verifier_marks_nothing(stack):
    response = generate(stack.coordinator_stub, PROMPTS[0], speculate=True, gamma=4, max_new_tokens=8)
    assert response.stats.synthetic_acceptance == 0.0


def test_a_synthetic_verdict_reads_the_device_once_for_the_token_it_keeps(tiny_target):
    """The verdict is drawn on the host, so a Verify reads one value, the target's token there,
    as the GPU check's timed rounds need. Seeded, the verdicts repeat; a failed call's are given back."""
    from specdec.runtime.sequence import drive
    from specdec.spec.sampling import SamplingConfig
    from tests.test_chained_drafts import reads
    from verifier.target_session import TargetSession
    seeded = SamplingConfig(seed=5)

    def verify(session, gamma):
        return drive(session.verify_steps(list(range(20, 20 + gamma)), None, seeded, synthetic_acceptance=0.5))

    runs = []
    for _ in range(2):
        session, verdicts = TargetSession(tiny_target, [1, 5, 9, 13]), []
        for gamma in (4, 1, 0, 4, 3, 4, 4):
            out, count = reads(lambda: verify(session, gamma))
            assert count == 1 and out.num_accepted <= gamma, (gamma, count)
            verdicts.append(out.num_accepted)
        runs.append(verdicts)
    assert runs[0] == runs[1] and len(set(runs[0])) > 1, runs
    state = session.snapshot()
    first = verify(session, 4)
    session.restore(state)
    assert verify(session, 4) == first
