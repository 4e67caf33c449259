"""What the drafter and the verifier servicers share: Info, GetTokenizer, and the
session lifecycle around a store with a TTL. Each service adds its own calls."""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from contextlib import contextmanager
from typing import Callable, Generic, Iterator, Protocol, TypeVar


from specdec.runtime import kernel_choices, torch_thread
from specdec.runtime.batching import CallStats, Scheduler, lean_batch_forward
from specdec.runtime.device import DeviceMark
from specdec.rpc.errors import InvalidArgument
from specdec.runtime.cost_curve import CostCurve, LiveCurve, RowCost, gathered_cost, pinned_curve
from specdec.spec.grammar import MAX_COMPILED_GRAMMAR_CHARS, GrammarCompiler, GrammarCursor
from specdec.spec.limits import MAX_PROPOSE_TOKENS, validate_token_ids
from specdec.runtime.sequence import PREFILL_CHUNK, Steps
from specdec.runtime.kv_pool import KVPool
from specdec.runtime.prefix_cache import PrefixCache
from specdec.runtime.models import LoadedModel
from specdec.rpc.security import ServerTls, refuse_if_exposed
from specdec.rpc.serving import RunningServer, start_server
from specdec.rpc.sessions import SessionStore, check_id
from specdec.service import start_profile
from specdec.service.warm_up import (GATHERED_ROWS, keep_dense_weights, measure_cost_curve, prepare_deferred_kernels,
                                     warm_and_time, warm_up)
from specdec.weights.tokenizer_fingerprint import tokenizer_files
from specdec.v1 import common_pb2

log = logging.getLogger(__name__)


class Transactional(Protocol):
    """A session whose calls can be undone: what `ModelServiceBase.session` needs."""
    def snapshot(self) -> object: ...
    def restore(self, state: object) -> None: ...


S = TypeVar("S", bound=Transactional)
T = TypeVar("T")
MAX_BATCH_ROWS = 512
KV_SHARE_OF_AVAILABLE = 0.4  # --kv-cache-mb 0: this share of the memory available at start
LIVE_REFRESH = 64  # forwards between re-sizings of the scheduler's batches on the live curve
MAX_CACHE_SALT_BYTES = 256  # as the public API's cache_salt (the coordinator sends a 32-byte digest)


def check_salt(salt: bytes) -> bytes:
    if len(salt) > MAX_CACHE_SALT_BYTES:
        raise InvalidArgument(f"cache_salt must be at most {MAX_CACHE_SALT_BYTES} bytes, got {len(salt)}")
    return bytes(salt)


class ModelServiceBase(Generic[S]):
    """Mixin for a servicer holding one model and its sessions."""

    def __init__(self, loaded: LoadedModel, new_session: Callable[..., S], store: SessionStore[S],
                 pool: KVPool | None = None, scheduler: Scheduler | None = None,
                 prefill_chunk: int = PREFILL_CHUNK, prefix: PrefixCache | None = None):
        self.loaded = loaded
        self.sessions = store
        self._new_session = new_session  # (loaded, prompt, pool, prefill=False) -> S
        self._tokenizer_files: dict[str, bytes] | None = None
        self.curve = CostCurve([], 0.0)      # measured at warm-up (or pinned)
        self.live: LiveCurve | None = None   # the measured curve, kept current from the forwards served
        self.pool = pool
        self.scheduler = scheduler or new_scheduler(loaded)
        self.prefill_chunk = prefill_chunk
        self.prefix = prefix  # prompts' KV blocks kept for later sessions (None: off)
        # Structured output: sessions' matchers, over this model's tokenizer (built on first use).
        self.grammars = GrammarCompiler(loaded.tokenizer, loaded.eos_token_ids)

    def run_call(self, steps: Steps[T]) -> tuple[T, common_pb2.BatchStats]:
        """A call's steps through the scheduler: its forwards batched with other
        sessions'; its result, and what the scheduler did for it (for the response)."""
        started = time.perf_counter()
        result, stats = self.scheduler.run(steps)
        return result, batch_stats(stats, self.scheduler.pending_calls + 1, (time.perf_counter() - started) * 1e3)

    def current_curve(self) -> CostCurve:
        return self.live.current() if self.live is not None else self.curve

    def follow_forwards(self, refresh_every: int = LIVE_REFRESH) -> None:
        """Keep the curve current from the scheduler's forwards, and size its batches on it."""
        self.live = LiveCurve(self.curve)
        scheduler = self.scheduler

        # The curve prices one session's rows (what γ costs it); a forward gathering several
        # sessions' calls runs the kernels fastest for its rows (lean's `_gathered`) and
        # teaches it nothing, unless batches keep every session's bits (--batch-invariant).
        invariant = self.loaded.lean is None or self.loaded.lean.batch_invariant

        def observed(rows: int, calls: int, ms: float, prefill_rows: int) -> None:
            if calls > 1 and not invariant:
                return
            self.live.observe(rows, ms, prefill_rows)
            if self.live.observed % refresh_every == 0:
                scheduler.cost = RowCost(self.live.current().forward_ms)
        scheduler.on_forward = observed

    def Info(self, request, context) -> common_pb2.ModelInfo:
        m, curve = self.loaded, self.current_curve()
        return common_pb2.ModelInfo(
            model=m.name, dtype=m.dtype, device=str(m.device), quantization=m.quantization,
            vocab_size=m.vocab_size, model_vocab_size=m.model_vocab_size, max_context=m.max_context,
            eos_token_ids=list(m.eos_token_ids), tokenizer_fingerprint=m.fingerprint,
            active_sessions=len(self.sessions), max_propose_tokens=MAX_PROPOSE_TOKENS,
            forward_ms=curve.forward_ms, prefill_ms_per_token=curve.prefill_ms_per_token,
            forwards=self.scheduler.forwards, forward_rows=self.scheduler.forward_rows,
            pending_calls=self.scheduler.pending_calls,
            kv_tokens_used=self.pool.used_tokens if self.pool else 0,
            kv_tokens_budget=self.pool.budget_tokens if self.pool else 0, session_ttl_s=self.sessions.ttl_s,
            kernel_choices=kernel_choices.choices(), sessions_ended_by_lease=self.sessions.ended_by_lease,
            sessions_reaped_idle=self.sessions.reaped_idle, kernels_pending=len(kernel_choices.state().deferred),
            **self._prefix_info())

    def _prefix_info(self) -> dict[str, int]:
        if self.prefix is None:
            return {}
        stats = self.prefix.stats()
        return dict(prefix_cache_blocks=stats.blocks, prefix_cache_tokens=stats.tokens,
                    prefix_cache_query_tokens=stats.query_tokens, prefix_cache_hit_tokens=stats.hit_tokens)

    def GetTokenizer(self, request, context) -> common_pb2.TokenizerFiles:
        if self._tokenizer_files is None:
            self._tokenizer_files = tokenizer_files(self.loaded.tokenizer)
        return common_pb2.TokenizerFiles(files=self._tokenizer_files)

    def StartSession(self, request, context) -> common_pb2.StartSessionResponse:
        prompt = list(request.prompt_token_ids)
        if not prompt:
            raise InvalidArgument("prompt_token_ids is empty: a session needs at least one token")
        if len(prompt) >= self.loaded.max_context:
            raise InvalidArgument(
                f"prompt has {len(prompt)} tokens; the context window of {self.loaded.name} is "
                f"{self.loaded.max_context}, leaving no room to generate")
        validate_token_ids(prompt, self.loaded.vocab_size, "prompt_token_ids")
        salt = check_salt(request.cache_salt)
        grammar = self._grammar(request, len(prompt))
        reused = [0]
        session = self.sessions.create(request.session_id, lambda: self._prefilled(prompt, salt, reused, grammar),
                                       owner=request.owner, lease_s=request.lease_s)
        return common_pb2.StartSessionResponse(
            session_id=request.session_id, cached_tokens=session.seq.cached,
            tokenizer_fingerprint=self.loaded.fingerprint, prefix_cached_tokens=reused[0])

    def _grammar(self, request, prompt_tokens: int) -> GrammarCursor | None:
        """The session's grammar (structured output), built before anything else is."""
        if not request.grammar:
            return None
        if len(request.grammar) > MAX_COMPILED_GRAMMAR_CHARS:
            raise InvalidArgument(f"grammar has {len(request.grammar):,} characters; at most "
                                  f"{MAX_COMPILED_GRAMMAR_CHARS:,}")
        if request.grammar_start > prompt_tokens:
            raise InvalidArgument(f"grammar_start={request.grammar_start} is past the prompt's {prompt_tokens} tokens")
        return self.grammars.cursor(request.grammar, request.grammar_start)

    def _prefilled(self, prompt: list[int], salt: bytes, reused: list[int], grammar: GrammarCursor | None) -> S:
        session = self._new_session(self.loaded, prompt, self.pool, prefill=False)
        session.grammar = grammar
        session.seq.cache_salt = salt
        if self.prefix is not None:
            reused[0] = self.prefix.attach(session.seq, salt)
        # The rest in chunks, through the scheduler: other sessions' rounds go on between them.
        done, _ = self.run_call(self._prefill_steps(session))
        if self.prefix is not None:
            self.prefix.store(session.seq, salt)
        # StartSession answers once the device has cached the prompt (a GPU runs the chunks after
        # they are queued, and nothing here reads them): the coordinator prices the drafter's
        # prefill by this call's latency.
        done.wait()
        return session

    def _prefill_steps(self, session: S) -> Steps[DeviceMark]:
        yield from session.seq.prefill_steps(self.prefill_chunk)
        return self.loaded.policy.mark()   # made on the torch thread, after the last chunk was queued

    def MatchPrefix(self, request, context) -> common_pb2.MatchPrefixResponse:
        prompt = list(request.prompt_token_ids)
        validate_token_ids(prompt, self.loaded.vocab_size, "prompt_token_ids")
        salt = check_salt(request.cache_salt)
        cached = self.prefix.match(prompt, salt) if self.prefix is not None else 0
        return common_pb2.MatchPrefixResponse(cached_tokens=cached)

    @contextmanager
    def session(self, session_id: str) -> Iterator[S]:
        """The session, held for one call. A call that fails leaves it exactly as
        it was (tokens, KV cache, round state, random generator): the calls check
        their input before changing anything, and this undoes whatever a failure
        past the checks had changed."""
        with self.sessions.use(session_id) as session:
            state = session.snapshot()
            try:
                yield session
            except BaseException:
                session.restore(state)
                raise
            if self.prefix is not None:
                # Blocks are kept as they fill, so an ended session's stay for a chat's
                # next turn, which may arrive before the coordinator's EndSession does.
                self.prefix.store(session.seq, session.seq.cache_salt)

    def KeepAlive(self, request, context) -> common_pb2.KeepAliveResponse:
        if not request.session_id and not request.owner:
            raise InvalidArgument("KeepAlive needs a session_id, an owner (with lease_s), or both")
        reply = common_pb2.KeepAliveResponse()
        if request.owner:
            reply.owned_sessions = self.sessions.renew(request.owner, request.lease_s)
        if request.session_id:
            check_id(request.session_id, "session_id")
            reply.existed = self.sessions.touch(request.session_id)
        return reply

    def EndSession(self, request, context) -> common_pb2.EndSessionResponse:
        check_id(request.session_id, "session_id")
        return common_pb2.EndSessionResponse(existed=self.sessions.remove(request.session_id))


def new_scheduler(loaded: LoadedModel, max_rows: int = MAX_BATCH_ROWS) -> Scheduler:
    """Batched forwards on the lean forward; on transformers' forward, each alone."""
    return Scheduler(lean_batch_forward(loaded.lean) if loaded.lean else None, max_rows=max_rows,
                     timer=loaded.policy.forward_timer())


def batch_stats(stats: CallStats, pending_calls: int, service_ms: float = 0.0) -> common_pb2.BatchStats:
    return common_pb2.BatchStats(forwards=stats.forwards, rows=stats.rows, max_rows=stats.max_rows,
                                 queue_ms=stats.queue_ms, pending_calls=pending_calls, calls=stats.calls,
                                 service_ms=service_ms)


def kv_pool(loaded: LoadedModel, kv_cache_mb: float) -> KVPool | None:
    """The service's KV cache budget: --kv-cache-mb, or with 0 a share of the memory
    available at start where the caches live (the GPU's free memory on a GPU, after the
    weights: the drafter, started first, leaves the verifier the rest). None for a model on
    transformers' forward (its own cache)."""
    if loaded.lean is None:
        return None
    budget = kv_cache_mb * 2**20 if kv_cache_mb > 0 else KV_SHARE_OF_AVAILABLE * loaded.policy.free_bytes()
    return KVPool.of_bytes(int(budget), loaded.lean.token_bytes())


@dataclass(frozen=True)
class ServeConfig:
    """How a model service serves: its command line's settings (specdec.service.settings
    declares the flags), as `serve_model` takes them."""
    host: str = "127.0.0.1"
    port: int = 0
    session_ttl_s: float = 600.0
    max_sessions: int = 256
    tls: ServerTls | None = None
    uds: str | None = None
    auth_token: str | None = None
    cost_curve_rows: int = 0            # rows the cost curve is timed over (0: not timed)
    cost_curve: CostCurve | None = None  # published as given instead of timed
    kv_cache_mb: float = 0.0
    prefill_chunk: int = PREFILL_CHUNK
    max_batch_rows: int = MAX_BATCH_ROWS
    prefill_weights: str = "dense"
    prefix_cache: str = "on"
    kernel_rows: int = 1
    batch_invariant: bool = False
    start_profile_setting: str = "on"


def serve_model(servicer_cls: type, session_cls: type, add_to_server: Callable, service_name: str,
                loaded: LoadedModel, config: ServeConfig | None = None, **settings) -> RunningServer:
    """Start a model service; it reports SERVING only once the model is warm.
    `cost_curve`: publish this curve instead of timing one at warm-up (None: the
    one the environment pins, else timed over `cost_curve_rows` rows, and with it the
    prefill paths of every chunk's row bucket; with `start_profile_setting` "on", what an earlier
    start timed under the same key where it still holds, start_profile's). `settings`:
    ServeConfig's fields, over `config`'s."""
    config = dataclasses.replace(config or ServeConfig(), **settings)
    refuse_if_exposed(service_name, config.host, config.tls, config.uds, config.auth_token)
    kernel_choices.choose_at(config.kernel_rows)
    if loaded.lean is not None:
        loaded.lean.batch_invariant = config.batch_invariant
    if config.prefill_chunk < 1 or config.max_batch_rows < 1:
        raise ValueError(f"--prefill-chunk ({config.prefill_chunk}) and --max-batch-rows "
                         f"({config.max_batch_rows}) must be >= 1")
    if config.prefill_weights == "dense":  # before the KV pool takes its share of what memory is left
        keep_dense_weights(loaded, service_name)
    store = SessionStore(ttl_s=config.session_ttl_s, max_sessions=config.max_sessions)
    store.start_reaper()
    pool = kv_pool(loaded, config.kv_cache_mb)
    scheduler = new_scheduler(loaded, config.max_batch_rows)
    prefix = PrefixCache(pool) if pool is not None and config.prefix_cache == "on" else None
    servicer = servicer_cls(loaded, session_cls, store, pool, scheduler, config.prefill_chunk, prefix)
    # A worker per session and a few spare, so health checks are answered under full load.
    running = start_server(lambda server: add_to_server(servicer, server), [service_name], host=config.host,
                           port=config.port, max_workers=config.max_sessions + 8, tls=config.tls, uds=config.uds,
                           auth_token=config.auth_token)
    running.on_stop = store.close
    pinned = config.cost_curve or pinned_curve(service_name)
    gathered: dict[int, float] = {}
    if pinned or config.cost_curve_rows <= 0:
        torch_thread.run(warm_up, loaded)
        servicer.curve = pinned or torch_thread.run(measure_cost_curve, loaded, config.cost_curve_rows)
    else:  # the curve timed, with the prefill and gathered buckets, or what a start before timed
        key = start_profile.profile_key(loaded.identity, str(loaded.device), dict(
            service=service_name, kernel_rows=config.kernel_rows, batch_invariant=config.batch_invariant,
            cost_curve_rows=config.cost_curve_rows, max_sessions=min(config.max_sessions, GATHERED_ROWS),
            prefill_chunk=config.prefill_chunk, prefill_weights=config.prefill_weights))
        kept = config.start_profile_setting == "on"
        timed = warm_and_time(loaded, service_name, key if kept else None, config.cost_curve_rows,
                              config.prefill_chunk, config.max_sessions)
        servicer.curve, gathered = timed.curve, timed.gathered
        if kept and timed.keep:
            def save_profile() -> None:  # at start, and at a clean stop with the choices made while serving
                # The start's curve, not the live one: served under load, it follows that load.
                start_profile.save(start_profile.StartProfile(timed.curve, gathered, kernel_choices.saved_choices()),
                                   key)
            if timed.timed:
                if timed.replaces:
                    start_profile.set_aside(key)
                save_profile()
            running.on_stop = lambda: (store.close(), save_profile())
    log.info("%s: forward ms by rows (1..%d): %s; prefill %.2f ms a token%s", service_name,
             len(servicer.curve.forward_ms), ", ".join(f"{ms:.1f}" for ms in servicer.curve.forward_ms),
             servicer.curve.prefill_ms_per_token, " (pinned, not measured)" if pinned else "")
    if choices := kernel_choices.choices():
        log.info("%s: kernels chosen by timing: %s", service_name, "; ".join(choices))
    if servicer.curve.forward_ms:  # batches sized on the measured curve
        scheduler.cost = RowCost(servicer.curve.forward_ms)
        scheduler.batch_cost = gathered_cost(servicer.curve.forward_ms[0], gathered)
        if not pinned:  # a pinned curve stays as given (tests, policy comparisons)
            servicer.follow_forwards()
    if pool is not None:
        log.info("%s: KV cache pool of %d tokens (%.0f MiB); batches of up to %d rows, prefill chunks of %d; "
                 "prefix cache %s", service_name, pool.budget_tokens, pool.budget_tokens * pool.token_bytes / 2**20,
                 config.max_batch_rows, config.prefill_chunk,
                 f"on ({prefix.block_tokens}-token blocks, within the pool)" if prefix else "off")
    running.set_serving(True)
    # Kernels left to make wait while a request is served: a call in progress, or a session open.
    prepare_deferred_kernels(service_name, running.stopped, busy=lambda: running.in_flight.count > 0 or len(store) > 0)
    return running
