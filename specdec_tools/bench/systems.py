"""The systems a bench run compares: the services, in-process transformers, llama.cpp."""
from __future__ import annotations

import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import torch
from transformers.generation.streamers import BaseStreamer

from coordinator.clients import DrafterClient, VerifierClient
from coordinator.gamma.bound import describe as describe_bound
from specdec.runtime import torch_thread
from specdec.runtime.models import LoadedModel
from specdec.rpc.errors import RemoteError
from specdec.rpc.serving import channel
from specdec.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from specdec_tools.launcher import BACKEND_TOKEN_ENV
from specdec_tools.bench.data import (AUTO, AUTO_MODEL, AUTO_NOSTOP, BF16, HF_ASSISTED, LLAMA_CPP, LLAMA_CPP_DRAFT,
                                      LLAMA_CPP_SPEC, Question, REPLICA, Run, TARGET_ONLY)


def service_curves(stack, say) -> dict:
    """The model services' cost curves as the run leaves them (each service keeps its
    own current from the forwards it serves), and what they allow speculation; {} where
    a service does not answer (said, and the run's results are kept)."""
    token = stack.env.get(BACKEND_TOKEN_ENV)
    curves = {}
    for name, client_cls in (("drafter", DrafterClient), ("verifier", VerifierClient)):
        client = client_cls(stack.child(name).address, token=token)
        try:
            info = client.info()
        except RemoteError as exc:
            say(f"no cost curves in the report: the {name}'s Info failed ({exc})")
            return {}
        finally:
            client.close()
        curves[name] = dict(forward_ms=[round(ms, 2) for ms in info.forward_ms],
                            prefill_ms_per_token=round(info.prefill_ms_per_token, 3))
    draft = curves["drafter"]["forward_ms"]
    curves["bound"] = describe_bound(curves["verifier"]["forward_ms"], draft[0] if draft else None)
    return curves


class ServiceSystems:
    """spec-gN and target-only: Generate calls to the coordinator over gRPC."""

    def __init__(self, address: str, max_new_tokens: int):
        self.channel = channel(address)
        self.stub = coordinator_pb2_grpc.CoordinatorStub(self.channel)
        self.max_new_tokens = max_new_tokens

    def run(self, system: str, question: Question, temperature: float, seed: int, prompt_ids: list[int],
            messages: list[dict] | None = None, cache_salt: str = "", label: str = "", turn: int = 1) -> Run:
        """`messages`: a conversation to continue instead of the question's first turn;
        `cache_salt`: one of its own keeps the prefix caches from finding anything."""
        mode = system.removesuffix(BF16)  # the bf16 stack serves the same systems
        request = coordinator_pb2.GenerateRequest(max_new_tokens=self.max_new_tokens, cache_salt=cache_salt)
        for message in messages or [{"role": "user", "content": question.prompt}]:
            request.messages.messages.add(role=message["role"], content=message["content"])
        request.sampling.CopyFrom(common_pb2.SamplingParams(temperature=temperature, seed=seed))
        if mode == TARGET_ONLY:
            request.speculation.enabled = False
        elif mode in (AUTO, AUTO_NOSTOP, AUTO_MODEL):
            # No gamma: the coordinator's default, auto. spec-auto keeps target-only's seed:
            # where its drafts are all lookups (the model cannot pay on the start curves)
            # it then samples target-only's tokens, so a sampled comparison is of time, not
            # of how long two different samples ran. The model's variants run unseeded: a
            # seeded sample drafted by the model is served at a fixed γ (reproducibility).
            if mode != AUTO:
                request.sampling.ClearField("seed")
            if mode == AUTO_NOSTOP:
                request.speculation.confidence_stop = False
            if mode == AUTO_MODEL:
                request.speculation.proposer = coordinator_pb2.PROPOSER_KIND_MODEL
        else:
            request.speculation.gamma = int(mode.removeprefix("spec-g").removesuffix(REPLICA))
        start = time.perf_counter()
        response = self.stub.Generate(request, timeout=3600)
        seconds = time.perf_counter() - start
        stats = response.stats
        # The services and the in-process baselines must see the same prompt.
        assert stats.prompt_tokens == len(prompt_ids), (stats.prompt_tokens, len(prompt_ids))
        return Run.of(label or system, question, temperature, list(response.token_ids), seconds, stats, turn)

    def close(self) -> None:
        self.channel.close()


class InProcessSystems:
    """hf-generate and hf-assisted: transformers in this process, same weights."""

    def __init__(self, target: LoadedModel, draft: LoadedModel, max_new_tokens: int):
        self.target, self.draft, self.max_new_tokens = target, draft, max_new_tokens

    @torch_thread.runs_on_it  # where the models were loaded: one OpenMP team in this process
    def run(self, system: str, question: Question, temperature: float, seed: int, prompt_ids: list[int]) -> Run:
        ids = torch.tensor([prompt_ids], device=self.target.device)
        sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else dict(
            do_sample=False, temperature=None, top_k=None, top_p=None)
        extra = dict(assistant_model=self.draft.model) if system == HF_ASSISTED else {}
        torch.manual_seed(seed)
        start = time.perf_counter()
        first = _FirstToken()
        with torch.no_grad():
            out = self.target.model.generate(ids, attention_mask=torch.ones_like(ids),
                                             max_new_tokens=self.max_new_tokens, streamer=first,
                                             pad_token_id=self.target.eos_token_ids[0], **sampling, **extra)
        seconds = time.perf_counter() - start
        new = out[0, ids.shape[1]:].tolist()
        # Count as the services do: output stops before the first EOS.
        eos = set(self.target.eos_token_ids)
        cut = next((i for i, t in enumerate(new) if t in eos), len(new))
        return Run.of(system, question, temperature, new[:cut], seconds, coordinator_pb2.GenerationStats(
            first_token_ms=(first.at - start) * 1e3 if first.at else 0.0))


class _FirstToken(BaseStreamer):
    """When generate() put out its first new token (its first put() is the prompt)."""

    def __init__(self):
        self.puts, self.at = 0, 0.0

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.at = time.perf_counter()

    def end(self) -> None:
        pass


# The probe: both GGUFs loaded as the bench loads them, a few tokens decoded from each.
_PROBE = """
import sys
from llama_cpp import Llama
for path in sys.argv[2:]:
    llm = Llama(model_path=path, n_threads=int(sys.argv[1]), n_ctx=256, verbose=False)
    for _, _ in zip(llm.generate(llm.tokenize(b"def add(a, b):"), reset=True, temp=0.0), range(4)):
        pass
"""


def llama_cpp_probe(ggufs: list[pathlib.Path], threads: int, timeout_s: float = 300.0) -> str | None:
    """None where llama.cpp loads each GGUF and decodes a few tokens in a child process; else
    why not. llama.cpp picks its kernels at load and a native fault ends the process that runs
    them (on an AMX Xeon VM its AMX matmul took a general protection fault), so the bench
    asks a child first and runs without its systems rather than dying with them."""
    try:
        result = subprocess.run([sys.executable, "-c", _PROBE, str(threads), *map(str, ggufs)],
                                capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"its probe did not finish in {timeout_s:.0f} s"
    if result.returncode == 0:
        return None
    code = result.returncode
    how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
    said = result.stderr.strip().splitlines()[-1:]
    return f"llama.cpp ended its probe with {how}" + (f" ({said[0][:200]})" if said else "")


class LlamaCppSystems:
    """llama-cpp and llama-cpp-spec: llama.cpp on the pair's GGUF files, in this process,
    same prompt ids. The binding's draft hook takes any proposer; here it is the draft
    GGUF, greedy, LLAMA_CPP_DRAFT tokens a round (the binding asks for logits of every
    row then, prefill included: its cost, not ours)."""

    def __init__(self, target_gguf: pathlib.Path, draft_gguf: pathlib.Path | None, threads: int,
                 max_new_tokens: int, eos_ids: tuple[int, ...], context: int):
        try:
            from llama_cpp import Llama
        except ImportError as error:
            raise SystemExit("bench: --llama-cpp needs llama-cpp-python: pip install llama-cpp-python "
                             "(it compiles llama.cpp; a few minutes)") from error
        options = dict(n_threads=threads, n_threads_batch=threads, n_ctx=context, verbose=False)
        self.engines = {LLAMA_CPP: Llama(model_path=str(target_gguf), **options)}
        if draft_gguf is not None:
            draft = _LlamaCppDraft(Llama(model_path=str(draft_gguf), **options), LLAMA_CPP_DRAFT)
            # logits_all=True said explicitly: the binding turns it on for a draft model but
            # sizes its score buffer from the argument (n_batch rows), which a prompt
            # longer than one batch overruns.
            self.engines[LLAMA_CPP_SPEC] = Llama(model_path=str(target_gguf), draft_model=draft, logits_all=True,
                                                 **options)
        self.max_new_tokens, self.eos = max_new_tokens, set(eos_ids)

    @torch_thread.runs_on_it  # as the in-process transformers systems
    def run(self, system: str, question: Question, temperature: float, seed: int, prompt_ids: list[int]) -> Run:
        llm = self.engines[system]
        llm.reset()  # no prefix reuse from the previous run
        if llm.draft_model is not None:
            llm.draft_model.llm.reset()
        llm.set_seed(seed)
        sampling = dict(temp=temperature, top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0, repeat_penalty=1.0)
        out: list[int] = []
        start = time.perf_counter()
        first_token_ms = 0.0
        for token in llm.generate(prompt_ids, reset=True, **sampling):
            first_token_ms = first_token_ms or (time.perf_counter() - start) * 1e3
            if token in self.eos:
                break
            out.append(token)
            if len(out) >= self.max_new_tokens:
                break
        seconds = time.perf_counter() - start
        return Run.of(system, question, temperature, out, seconds,
                      coordinator_pb2.GenerationStats(first_token_ms=first_token_ms))


class _LlamaCppDraft:
    """A draft model for llama-cpp-python's `draft_model` hook: another GGUF, greedy.
    Its KV cache follows the target's by prefix match (the binding keeps what matches)."""

    def __init__(self, llm, num_tokens: int):
        self.llm, self.num_tokens = llm, num_tokens

    def __call__(self, input_ids, **kwargs):
        drafted = []
        for token in self.llm.generate(input_ids.tolist(), reset=True, temp=0.0, top_k=1):  # keeps the matching prefix
            drafted.append(token)
            if len(drafted) >= self.num_tokens:
                break
        return np.array(drafted, dtype=np.intc)


def chat_ids(tokenizer, prompt: "str | list[dict]") -> list[int]:
    """The coordinator's own recipe for `messages` (template as text, then encode):
    a question, or a whole conversation."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


# --- summary ------------------------------------------------------------------
