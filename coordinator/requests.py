"""GenerateRequest (proto) -> GenerationRequest (domain), validated with
messages a person can act on, and stats/deltas back to proto."""
from __future__ import annotations

import dataclasses
import hashlib

from dataclasses import dataclass

from specdec.rpc.errors import InvalidArgument, clip
from specdec.spec.limits import MAX_TOP_LOGPROBS, validate_token_ids
from specdec.spec.grammar import Constraint, GrammarCompiler
from specdec.v1 import common_pb2, coordinator_pb2
from specdec.spec.wire import sampling_from_proto

from coordinator.engine import GenerationRequest, Update
from coordinator.stats import stats_to_proto
from coordinator.proposers import KINDS, checked_sources

CHAT_ROLES = ("system", "user", "assistant", "tool")
# ProposerKind values -> the kinds registered in coordinator.proposers (PROPOSER_KIND_<NAME> asks for kind
# <name>; unspecified: the server's --proposer).
PROPOSER_KINDS = {coordinator_pb2.PROPOSER_KIND_UNSPECIFIED: "",
                  **{coordinator_pb2.ProposerKind.Value(f"PROPOSER_KIND_{name.upper()}"): name for name in KINDS}}
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_CACHE_SALT_CHARS = 256
MAX_CHAT_MESSAGES = 4096  # a conversation's turns; its size in tokens is bounded by the context anyway


# A long text is first tokenized up to this many characters per token of room.
PROBE_CHARS_PER_TOKEN = 8


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    max_context: int             # the target's
    default_max_new_tokens: int
    default_gamma: int | None    # None: adaptive (see coordinator.gamma)
    max_propose_tokens: int     # the most tokens the proposer drafts in one call
    gamma_max: int = 8           # adaptive γ ranges over [0, gamma_max]
    # Adaptive γ follows timing, so seeded sampling keeps a fixed γ: the best on the services'
    # warm-up curves at the prior acceptance (coordinator.service; 0 where drafting cannot pay).
    seeded_gamma: int = 4
    max_token_chars: int = 1024  # the most characters one token of the tokenizer decodes to


def max_token_chars(tokenizer) -> int:
    """An upper bound on the characters one token stands for: its vocabulary
    string's length (byte-level BPE spells each byte as one character; SentencePiece
    spells the text itself, or '<0xNN>' for a single byte)."""
    return max(len(token) for token in tokenizer.get_vocab())


def encode_within(tokenizer, text: str, room: int, limits: Limits, add_special_tokens: bool = True) -> list[int]:
    """Tokenize `text`, refusing text that cannot fit in `room` tokens before paying
    for the tokenization of all of it (a 3.5 MB prompt took 3.5 s to tokenize)."""
    def refuse(at_least: int) -> InvalidArgument:
        return InvalidArgument(
            f"the prompt ({len(text):,} characters, at least {at_least:,} tokens) does not fit the {room:,} tokens "
            f"the target's context window ({limits.max_context}) leaves after max_new_tokens; shorten the prompt "
            "or lower max_new_tokens", "prompt")
    # 1. By its length alone: no token stands for more than max_token_chars characters.
    if len(text) > room * limits.max_token_chars:
        raise refuse(-(-len(text) // limits.max_token_chars))
    # 2. A long text: tokenize a prefix first, cut before a space (where the
    #    pre-tokenizer splits anyway, so the prefix has no more tokens than the whole).
    probe = room * PROBE_CHARS_PER_TOKEN
    if len(text) > 2 * probe:
        cut = text.rfind(" ", 0, probe)
        if cut > 0:
            counted = len(tokenizer.encode(text[:cut], add_special_tokens=False))
            if counted > room:
                raise refuse(counted)
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def check_chat_size(messages, room: int, limits: Limits) -> None:
    """Refuse a conversation that cannot fit before templating it (templating
    300,000 messages took 1.2 s, and held up other requests meanwhile): a
    template writes each message's content, and at least one token for each."""
    if len(messages) > MAX_CHAT_MESSAGES:
        raise InvalidArgument(f"messages has {len(messages):,} entries; at most {MAX_CHAT_MESSAGES:,} are taken",
                              "messages")
    if len(messages) > room:
        raise InvalidArgument(
            f"messages has {len(messages):,} entries, at least a token each, which does not fit the {room:,} tokens "
            f"the target's context window ({limits.max_context}) leaves after max_new_tokens; send fewer messages "
            "or lower max_new_tokens", "messages")
    chars = sum(len(m.content) for m in messages)
    if chars > room * limits.max_token_chars:
        raise InvalidArgument(
            f"the messages' contents ({chars:,} characters, at least {-(-chars // limits.max_token_chars):,} "
            f"tokens) do not fit the {room:,} tokens the target's context window ({limits.max_context}) leaves "
            "after max_new_tokens; shorten the conversation or lower max_new_tokens", "messages")


def prompt_ids(request: coordinator_pb2.GenerateRequest, tokenizer, limits: Limits, room: int) -> list[int]:
    """The prompt's token ids; `room` is how many tokens the context leaves for it."""
    kind = request.WhichOneof("input")
    if kind is None:
        raise InvalidArgument("set one of prompt, messages or token_ids", "prompt")
    if kind == "prompt":
        if not request.prompt:
            raise InvalidArgument("prompt is empty", "prompt")
        ids = encode_within(tokenizer, request.prompt, room, limits)
    elif kind == "messages":
        messages = request.messages.messages
        if not messages:
            raise InvalidArgument("messages is empty", "messages")
        check_chat_size(messages, room, limits)
        for i, m in enumerate(messages):
            if m.role not in CHAT_ROLES:
                raise InvalidArgument(f"messages[{i}].role is {clip(m.role)}; expected one of {', '.join(CHAT_ROLES)}",
                                      f"messages[{i}].role")
        if tokenizer.chat_template is None:
            raise InvalidArgument("the target model's tokenizer has no chat template; send prompt or token_ids")
        text = tokenizer.apply_chat_template([{"role": m.role, "content": m.content} for m in messages],
                                             tokenize=False, add_generation_prompt=True)
        ids = encode_within(tokenizer, text, room, limits, add_special_tokens=False)
    else:
        ids = list(request.token_ids.ids)
        if not ids:
            raise InvalidArgument("token_ids is empty", "token_ids")
        validate_token_ids(ids, limits.vocab_size, "token_ids")
    if not ids:
        raise InvalidArgument("the prompt tokenizes to no tokens", "prompt")
    return ids


def constraint_from_proto(msg: common_pb2.Constraint) -> Constraint | None:
    """A request's constraint as asked (None: free text)."""
    kind = msg.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "json_object":
        if not msg.json_object:
            raise InvalidArgument("sampling.constraint.json_object must be true (leave the constraint unset for "
                                  "free text)", "sampling.constraint.json_object")
        return Constraint("json_object")
    if kind == "choice":
        return Constraint("choice", choices=tuple(msg.choice.choices))
    return Constraint(kind, getattr(msg, kind))


def to_domain(request: coordinator_pb2.GenerateRequest, tokenizer, limits: Limits,
              speculation_available: bool, grammars: GrammarCompiler | None = None) -> GenerationRequest:
    if request.sampling.constraint_fingerprint:
        raise InvalidArgument("sampling.constraint_fingerprint is the coordinator's own (it fingerprints the "
                              "compiled constraint); leave it empty and set sampling.constraint",
                              "sampling.constraint_fingerprint")
    sampling = sampling_from_proto(request.sampling)
    max_new = request.max_new_tokens if request.HasField("max_new_tokens") else limits.default_max_new_tokens
    if max_new <= 0:
        raise InvalidArgument(f"max_new_tokens must be > 0, got {max_new}", "max_new_tokens")
    if max_new >= limits.max_context:
        raise InvalidArgument(
            f"max_new_tokens ({max_new}) exceeds the target's context window ({limits.max_context}), leaving "
            "no room for a prompt; lower max_new_tokens", "max_new_tokens")
    ids = prompt_ids(request, tokenizer, limits, limits.max_context - max_new)
    if len(ids) + max_new > limits.max_context:
        raise InvalidArgument(
            f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new}) exceeds the target's context window "
            f"({limits.max_context}); shorten the prompt or lower max_new_tokens", "max_new_tokens")
    stop = tuple(request.stop)
    if len(stop) > MAX_STOP_STRINGS or any(not s or len(s) > MAX_STOP_CHARS for s in stop):
        raise InvalidArgument(f"stop takes at most {MAX_STOP_STRINGS} non-empty strings of up to "
                              f"{MAX_STOP_CHARS} characters", "stop")
    enabled = not request.speculation.HasField("enabled") or request.speculation.enabled
    gamma, adaptive, free_only = 0, False, False  # target-only, asked for or: this coordinator has no proposer
    if enabled and speculation_available:
        gamma = request.speculation.gamma or limits.default_gamma
        if gamma is None and sampling.seed is not None and not sampling.greedy:
            # Where the model drafts, a seeded sample depends on where it drafted, so a γ
            # chosen from timings would make it depend on machine load: a fixed γ. Lookups
            # never move it (rejection.py): where the model cannot pay on the start curves
            # (seeded_gamma 0), the free sources draft alone, adaptively.
            if limits.seeded_gamma == 0:
                free_only = True
            else:
                gamma = min(limits.seeded_gamma, limits.max_propose_tokens)
        if gamma is None:
            gamma, adaptive = min(limits.gamma_max, limits.max_propose_tokens), True
        if gamma > limits.max_propose_tokens:
            raise InvalidArgument(f"speculation.gamma={gamma} is over the proposer's limit of "
                                  f"{limits.max_propose_tokens}", "speculation.gamma")
    if request.speculation.proposer not in PROPOSER_KINDS:
        raise InvalidArgument(f"speculation.proposer={request.speculation.proposer} is not a ProposerKind",
                              "speculation.proposer")
    confidence_stop = adaptive and (not request.speculation.HasField("confidence_stop")
                                    or request.speculation.confidence_stop)
    if len(request.cache_salt) > MAX_CACHE_SALT_CHARS:
        raise InvalidArgument(f"cache_salt has {len(request.cache_salt)} characters; at most "
                              f"{MAX_CACHE_SALT_CHARS} (a hash of what should keep caches apart is enough)",
                              "cache_salt")
    if request.top_logprobs > MAX_TOP_LOGPROBS or (request.top_logprobs and not request.logprobs):
        raise InvalidArgument(f"top_logprobs={request.top_logprobs}: at most {MAX_TOP_LOGPROBS}, and only with "
                              "logprobs set", "top_logprobs")
    # The frequency and presence penalties count output tokens only: from the prompt's end on,
    # in both model services' sessions (each holds the prompt's ids, then the output's).
    sampling = dataclasses.replace(sampling, penalty_start=len(ids))
    # A structured output: compiled once, here (a bad one is refused before any session starts).
    grammar = ""
    constraint = constraint_from_proto(request.sampling.constraint)
    if constraint is not None:
        if request.ignore_eos:
            raise InvalidArgument("ignore_eos cannot be combined with a constraint: the grammar ends the output "
                                  "with EOS", "ignore_eos")
        if grammars is None:
            raise InvalidArgument("this server takes no constraints", "sampling.constraint")
        compiled = grammars.compile(constraint)
        grammar, sampling = compiled.grammar, dataclasses.replace(sampling, constraint=compiled.fingerprint)
    return GenerationRequest(tuple(ids), max_new, sampling, gamma, stop, adaptive, request.ignore_eos,
                             confidence_stop, PROPOSER_KINDS[request.speculation.proposer],
                             request.cache_salt.encode("utf-8"),
                             request.top_logprobs if request.logprobs else None,
                             checked_sources(request.speculation.sources), free_only, grammar)


def prefix_salt(request_salt: bytes, caller: str, shared: bool) -> bytes:
    """What the model services' prefix caches key a request's blocks under: its own
    cache_salt, and (unless the server shares its cache across callers) who called,
    so one caller cannot time another's prompts."""
    parts = [request_salt] if shared else [caller.encode("utf-8"), request_salt]
    return hashlib.sha256(b"\0".join(parts)).digest() if any(parts) else b""


def update_to_proto(update: Update, with_stats: bool) -> coordinator_pb2.GenerateResponse:
    response = coordinator_pb2.GenerateResponse(text=update.delta.text, token_ids=update.delta.token_ids,
                                                logprobs=update.delta.logprobs)
    if with_stats and update.delta.finish_reason is not None:
        response.finish_reason = int(update.delta.finish_reason)
        response.stats.CopyFrom(stats_to_proto(update.stats))
    return response


def request_attributes(request: coordinator_pb2.GenerateRequest, domain: GenerationRequest, model: str,
                       draft_model: str) -> dict:
    """GenAI semantic-convention attributes of a request; never prompt text or ids."""
    s = domain.sampling
    attributes = {
        "gen_ai.operation.name": "chat" if request.WhichOneof("input") == "messages" else "text_completion",
        "gen_ai.request.model": model,
        "gen_ai.request.temperature": s.temperature, "gen_ai.request.top_p": s.top_p,
        "gen_ai.request.top_k": s.top_k, "gen_ai.request.max_tokens": domain.max_new_tokens,
        "gen_ai.usage.input_tokens": len(domain.prompt_ids),
        "specdec.draft_model": draft_model,
        "specdec.gamma_mode": "off" if domain.gamma_max == 0 else "auto" if domain.adaptive else "fixed",
    }
    if s.seed is not None:
        attributes["gen_ai.request.seed"] = s.seed
    return attributes


def response_attributes(update: Update) -> dict:
    stats, reason = update.stats, update.delta.finish_reason
    return {"gen_ai.usage.output_tokens": stats.output_tokens,
            "gen_ai.response.finish_reasons": [reason.name.lower()] if reason is not None else [],
            "specdec.rounds": stats.rounds, "specdec.draft_tokens": stats.draft_tokens,
            "specdec.accepted_tokens": stats.accepted_tokens,
            "specdec.prefix_cached_tokens": stats.prefix_cached_tokens,
            "specdec.draft.prefix_cached_tokens": stats.draft_prefix_cached_tokens}
