"""Structured outputs: a request's constraint (a JSON schema, a regex, a choice, a
grammar), compiled once by the coordinator into llguidance's grammar, and the
matcher each side runs over the output: no torch, so the coordinator holds it too.

The grammar is part of the one sampling config: the verifier masks every row it
scores with the grammar's state after the draft prefix before that row, the
drafter drafts under the same masks, and the coordinator cuts lookups where the
grammar forbids a token and drafts the tokens it forces (proposers/grammar.py).
A forbidden draft token then has target probability 0 and is rejected, so the
output is the target's own distribution under the constraint, whatever drafted.

llguidance was chosen by measurement (docs/structured-outputs.md): no runtime
dependencies, masks in tens of microseconds, forced tokens and rollback built in.
"""
from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Sequence

from specdec.rpc.errors import FailedPrecondition, InvalidArgument, clip

log = logging.getLogger("specdec.grammar")
KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_CONSTRAINT_BYTES = 128 << 10      # a schema, regex or grammar; the request is capped at 4 MiB
MAX_CHOICES = 4096
MAX_COMPILED_GRAMMAR_CHARS = 2 << 20  # what a service takes in StartSession (under gRPC's 4 MiB)
# llguidance's own fuel limits bound what one compile or one mask may cost (its
# speeds: ~50k lexer fuel/ms, ~20k Earley items/ms): a grammar past them is refused
# in milliseconds instead of holding a service.
LEXER_FUEL = 1_000_000
STEP_LEXER_FUEL = 200_000
STEP_MAX_ITEMS = 50_000
MAX_GRAMMAR_SIZE = 500_000
# JSON as models write it and json.dumps prints it: `, ` and `: `, no other whitespace
# (llguidance's default allows any run of it, where a small model can loop, and
# then forces nothing between keys). A schema's "x-guidance" options override it.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
COMPILE_BUDGET_S = 2.0                # a compile (lazy lexer included) past this is refused


def _llguidance():
    # Imported when a constraint is used: the services start without paying for it.
    import llguidance
    return llguidance


@dataclass(frozen=True)
class Constraint:
    """What a request asked for, as it came (the proto's oneof, or the HTTP fields)."""
    kind: str                 # one of KINDS
    text: str = ""            # the schema (JSON text), regex or grammar; unused for json_object
    choices: tuple[str, ...] = ()

    def source(self) -> tuple[str, str]:
        """(llguidance's format name, its text) for `llguidance.grammar_from`."""
        if self.kind == "json_object":
            return "json_schema", '{"type": "object"}'
        if self.kind == "choice":
            return "choice", json.dumps(list(self.choices))
        return {"json_schema": "json_schema", "regex": "regex", "grammar": "grammar"}[self.kind], self.text


def fingerprint(grammar: str) -> str:
    """What both services check a call's sampling config against (empty: no constraint)."""
    return hashlib.sha256(grammar.encode()).hexdigest()[:32] if grammar else ""


@dataclass(frozen=True)
class Compiled:
    grammar: str              # llguidance's grammar, as sent to both services
    fingerprint: str
    compile_ms: float


class GrammarCompiler:
    """One tokenizer's grammars: what the coordinator compiles each request's
    constraint with, and what each model service builds its sessions' matchers
    with. The tokenizers are identical on all three (their fingerprints are
    checked), so a grammar valid at the coordinator is valid at both services."""

    def __init__(self, tokenizer, eos_token_ids: Sequence[int]):
        self._hf = tokenizer
        self._eos = list(eos_token_ids)
        self._tokenizer = None    # llguidance's, built on first use (about a second for a 150k vocabulary)
        self._lock = threading.Lock()

    @property
    def tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                from llguidance.hf import from_tokenizer
                started = time.perf_counter()
                try:
                    self._tokenizer = from_tokenizer(self._hf, eos_token=self._eos)
                except ValueError as exc:   # a slow (Python) tokenizer: llguidance reads the fast one's JSON
                    raise FailedPrecondition(f"structured outputs need a fast tokenizer; this model's is "
                                             f"{type(self._hf).__name__} ({exc})") from exc
                log.info("grammar engine: llguidance's view of the %d-token vocabulary built in %.2f s",
                         self._tokenizer.vocab_size, time.perf_counter() - started)
            return self._tokenizer

    def prepare_in_background(self) -> None:
        """Build the tokenizer's view off the first request's path (the coordinator does)."""
        threading.Thread(target=lambda: self.tokenizer, name="grammar-tokenizer", daemon=True).start()

    @staticmethod
    def limits():
        return _llguidance().LLParserLimits(
            initial_lexer_fuel=LEXER_FUEL, step_lexer_fuel=STEP_LEXER_FUEL, step_max_items=STEP_MAX_ITEMS,
            max_grammar_size=MAX_GRAMMAR_SIZE)

    def compile(self, constraint: Constraint, param: str = "sampling.constraint") -> Compiled:
        """The request's grammar, checked: InvalidArgument naming what is wrong."""
        tokenizer = self.tokenizer        # built once: not the request's compile time
        started = time.perf_counter()
        _check_shape(constraint, param)
        fmt, text = constraint.source()
        if constraint.kind == "json_schema":
            _check_schema(text, param)
        llg = _llguidance()
        try:
            grammar = llg.LLMatcher.grammar_from_json_schema(text, defaults=JSON_STYLE) if fmt == "json_schema" \
                else llg.grammar_from(fmt, text)
        except (ValueError, RuntimeError) as exc:
            raise InvalidArgument(f"{param}: the {constraint.kind} does not compile: {clip(str(exc), 400)}",
                                  param) from exc
        failed, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer, limits=self.limits())
        if failed:
            raise InvalidArgument(f"{param}: the {constraint.kind} does not compile: "
                                  f"{clip(' '.join(messages), 400)}", param)
        # Building the matcher and its first mask runs the lazy parts (the lexer's
        # first states): a grammar that is slow there is refused here, once, rather
        # than in both services' first steps; one that admits nothing, too.
        matcher = self.matcher(grammar)
        mask = bytearray(matcher.compute_bitmask())
        for eos in self._eos:   # an output of EOS alone is no output
            if eos >> 5 < len(mask) // 4:
                mask[(eos >> 5) * 4 + (eos & 31) // 8] &= ~(1 << (eos & 7)) & 0xFF
        if matcher.is_error() or not any(mask):
            raise InvalidArgument(f"{param}: the {constraint.kind} admits no output (nothing but the empty "
                                  f"string){': ' + _first_line(matcher.get_error()) if matcher.is_error() else ''}",
                                  param)
        compile_s = time.perf_counter() - started
        if compile_s > COMPILE_BUDGET_S:
            raise InvalidArgument(f"{param}: the {constraint.kind} took {compile_s:.1f} s to compile, over the "
                                  f"{COMPILE_BUDGET_S:g} s allowed; simplify it", param)
        return Compiled(grammar, fingerprint(grammar), compile_s * 1e3)

    def matcher(self, grammar: str):
        llg = _llguidance()
        return llg.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self.limits())

    def cursor(self, grammar: str, start: int) -> "GrammarCursor":
        """A session's matcher over its sequence's tokens from `start` (the output's first position)."""
        matcher = self.matcher(grammar)
        if matcher.is_error():
            raise FailedPrecondition(f"the session's grammar does not compile here: {_first_line(matcher.get_error())}")
        return GrammarCursor(matcher, start, fingerprint(grammar))


def _check_shape(constraint: Constraint, param: str) -> None:
    if constraint.kind not in KINDS:
        raise InvalidArgument(f"{param}: unknown constraint {constraint.kind!r}; one of {', '.join(KINDS)}", param)
    size = len(constraint.text.encode()) + sum(len(c.encode()) for c in constraint.choices)
    if size > MAX_CONSTRAINT_BYTES:
        raise InvalidArgument(f"{param}: the {constraint.kind} is {size:,} bytes, over the "
                              f"{MAX_CONSTRAINT_BYTES:,} allowed", param)
    if constraint.kind in ("json_schema", "regex", "grammar") and not constraint.text.strip():
        raise InvalidArgument(f"{param}: the {constraint.kind} is empty", param)
    if constraint.kind == "choice":
        if not constraint.choices or len(constraint.choices) > MAX_CHOICES:
            raise InvalidArgument(f"{param}: a choice needs 1 to {MAX_CHOICES} strings, got "
                                  f"{len(constraint.choices)}", param)
        if not all(constraint.choices):
            raise InvalidArgument(f"{param}: a choice cannot be the empty string", param)


def _check_schema(text: str, param: str) -> None:
    """The schema is JSON and a valid JSON Schema (jsonschema's metaschema check): a
    typo such as {"type": "strin"} is named here rather than compiled into nonsense."""
    import jsonschema
    try:
        schema = json.loads(text)
    except ValueError as exc:
        raise InvalidArgument(f"{param}: the JSON schema is not JSON: {exc}", param) from exc
    if not isinstance(schema, (dict, bool)):
        raise InvalidArgument(f"{param}: a JSON schema is an object, got {type(schema).__name__}", param)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.path) or "(root)"
        raise InvalidArgument(f"{param}: invalid JSON schema at {where}: {clip(exc.message, 300)}", param) from exc


class GrammarCursor:
    """A matcher that follows a sequence's output tokens: `follow(output)` rolls it
    back to what it shares with `output` and consumes the rest, so it is right after
    any rollback the session's KV cache makes. Masks are llguidance's bitmasks: one
    bit per token id, (vocab + 31) // 32 little-endian int32 words."""

    def __init__(self, matcher, start: int, fingerprint: str):
        self.matcher = matcher
        self.start = start              # the output's first position in the session's sequence
        self.fingerprint = fingerprint
        self.consumed: list[int] = []

    def check(self, constraint_fingerprint: str) -> None:
        if constraint_fingerprint != self.fingerprint:
            raise FailedPrecondition("the call's constraint is not the one its session was started with "
                                     f"({constraint_fingerprint or 'none'} != {self.fingerprint})")

    def follow(self, tokens: Sequence[int]) -> None:
        """Bring the matcher to the session's sequence `tokens` (prompt included)."""
        output = list(tokens[self.start:])
        common = min(len(output), len(self.consumed))
        if output[:common] != self.consumed[:common]:
            common = next(i for i in range(common) if output[i] != self.consumed[i])
        if common < len(self.consumed):
            self.matcher.rollback(len(self.consumed) - common)
            del self.consumed[common:]
        for token in output[common:]:
            self._consume(token)

    def _consume(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise FailedPrecondition(f"token {token} breaks the request's grammar at output position "
                                     f"{len(self.consumed)}: {_first_line(self.matcher.get_error())}")
        self.consumed.append(token)

    def mask(self) -> bytes:
        return self.matcher.compute_bitmask()

    def row_masks(self, row_tokens: Sequence[int], rows: int) -> list[bytes | None]:
        """[rows] the mask of each row: row 0 at the current state, row i + 1 after
        row_tokens[i]. From the first token its row's mask forbids, the rows after it
        read None (unconstrained): the rejection sampler never reaches them, as that
        token has probability 0; so do the rows after the grammar's end (its EOS ends
        the output). The matcher is left where it was."""
        masks: list[bytes | None] = []
        taken, free = 0, False
        for i in range(rows):
            mask = None if free else self.mask()
            if mask is not None and not any(mask):
                mask = None   # the grammar has ended (its EOS was consumed): the output ends before this row
            masks.append(mask)
            free = mask is None
            if not free and i < len(row_tokens) and i + 1 < rows:
                token = int(row_tokens[i])
                if allows(mask, token) and self.matcher.consume_token(token):
                    taken += 1
                else:
                    free = True   # a forbidden token: rejected, so no row after it is read
        if taken:
            self.matcher.rollback(taken)
        return masks

    @property
    def stopped(self) -> bool:
        return self.matcher.is_stopped()

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens`, from the current state, the grammar allows."""
        return self.matcher.validate_tokens(list(tokens)) if tokens else 0

    def forced(self) -> list[int]:
        """The tokens the grammar admits alone from the current state (llguidance's fast-forward)."""
        return [] if self.matcher.is_stopped() else list(self.matcher.compute_ff_tokens())


def _first_line(error: str) -> str:
    """llguidance's error without the parser state it appends."""
    return clip(error.split("\n<state>")[0].strip(), 300)


def allows(mask: bytes, token: int) -> bool:
    word = token >> 5
    return word * 4 < len(mask) and bool(int.from_bytes(mask[word * 4: word * 4 + 4], "little") >> (token & 31) & 1)
