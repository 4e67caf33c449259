"""What the drafter and the verifier servicers share: Info, GetTokenizer, and the
session lifecycle around a store with a TTL. Each service adds its own calls."""
from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from typing import Callable, Generic, Iterator, Protocol, TypeVar

import psutil
import torch

from specdec.runtime import dense_rows, kernel_choices, torch_thread
from specdec.runtime.batching import CallStats, Scheduler, lean_batch_forward
from specdec.rpc.errors import InvalidArgument
from specdec.runtime.cost_curve import CostCurve, LiveCurve, RowCost, gathered_cost, pinned_curve
from specdec.spec.limits import MAX_PROPOSE_TOKENS, validate_token_ids
from specdec.runtime.sequence import PREFILL_CHUNK, SequenceCache, Steps, drive
from specdec.runtime.kv_pool import KVPool
from specdec.runtime.prefix_cache import PrefixCache
from specdec.runtime.models import LoadedModel
from specdec.rpc.security import ServerTls, refuse_if_exposed
from specdec.rpc.serving import RunningServer, start_server
from specdec.rpc.sessions import SessionStore, check_id
from specdec.service import start_profile
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

    def run_call(self, steps: Steps[T]) -> tuple[T, common_pb2.BatchStats]:
        """A call's steps through the scheduler: its forwards batched with other
        sessions'; its result, and what the scheduler did for it (for the response)."""
        result, stats = self.scheduler.run(steps)
        return result, batch_stats(stats, self.scheduler.pending_calls + 1)

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
            sessions_reaped_idle=self.sessions.reaped_idle, **self._prefix_info())

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
        reused = [0]
        session = self.sessions.create(request.session_id, lambda: self._prefilled(prompt, salt, reused),
                                       owner=request.owner, lease_s=request.lease_s)
        return common_pb2.StartSessionResponse(
            session_id=request.session_id, cached_tokens=session.seq.cached,
            tokenizer_fingerprint=self.loaded.fingerprint, prefix_cached_tokens=reused[0])

    def _prefilled(self, prompt: list[int], salt: bytes, reused: list[int]) -> S:
        session = self._new_session(self.loaded, prompt, self.pool, prefill=False)
        session.seq.cache_salt = salt
        if self.prefix is not None:
            reused[0] = self.prefix.attach(session.seq, salt)
        # The rest in chunks, through the scheduler: other sessions' rounds go on between them.
        self.run_call(session.seq.prefill_steps(self.prefill_chunk))
        if self.prefix is not None:
            self.prefix.store(session.seq, salt)
        return session

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
    return Scheduler(lean_batch_forward(loaded.lean) if loaded.lean else None, max_rows=max_rows)


def batch_stats(stats: CallStats, pending_calls: int) -> common_pb2.BatchStats:
    return common_pb2.BatchStats(forwards=stats.forwards, rows=stats.rows, max_rows=stats.max_rows,
                                 queue_ms=stats.queue_ms, pending_calls=pending_calls, calls=stats.calls)


def kv_pool(loaded: LoadedModel, kv_cache_mb: float) -> KVPool | None:
    """The service's KV cache budget: --kv-cache-mb, or with 0 a share of the memory
    available at start. None for a model on transformers' forward (its own cache)."""
    if loaded.lean is None:
        return None
    budget = kv_cache_mb * 2**20 if kv_cache_mb > 0 else KV_SHARE_OF_AVAILABLE * available_memory()
    return KVPool.of_bytes(int(budget), loaded.lean.token_bytes())


def available_memory() -> int:
    """Bytes this process can still take: the machine's available memory, or less
    under a cgroup limit (a container's: psutil sees the host's memory there)."""
    available = psutil.virtual_memory().available
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            limit = open(limit_file).read().strip()
            usage = int(open(usage_file).read().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 2**60:  # "max", or v1's huge number: no limit
            available = min(available, max(int(limit) - usage, 0))
        break
    return available


def warm_up(loaded: LoadedModel) -> None:
    """One short forward so the first request does not pay for lazy init."""
    ids = loaded.tokenizer.encode("warm up", add_special_tokens=False) or [0]
    SequenceCache(loaded, ids).forward([], keep_last=1)


def time_prefill_buckets(loaded: LoadedModel, prefill_chunk: int = PREFILL_CHUNK) -> None:
    """Prefill one chunk of each row bucket a chunk can fall in, so kernel_choices.pick has
    timed its paths before any request meets it (otherwise the request that does
    pays: the first 228-token prompt on an AVX2 EPYC waited 10.3 s for its first
    token where the next waited 5.9)."""
    if loaded.device.type != "cpu":  # the timed paths are the CPU's
        return
    filler = [(7 * i + 3) % loaded.vocab_size for i in range(prefill_chunk + 1)]
    for rows in sorted({min(kernel_choices.bucket(n), prefill_chunk)
                        for n in range(dense_rows.MIN_PREFILL_ROWS, prefill_chunk + 1)}):
        drive(SequenceCache(loaded, filler[:rows + 1]).prefill_steps(chunk=rows))  # one chunk of `rows`


GATHERED_ROWS = 32  # the largest batch of decode rows timed at warm-up (more: timed at its first forward)


def time_gathered_buckets(loaded: LoadedModel, max_sessions: int) -> dict[int, float]:
    """For each row bucket n up to GATHERED_ROWS (and max_sessions), forwards of n sessions'
    decode rows: the first chooses the kernels for batches of several sessions (lean's
    `_gathered`) and makes their int8 weights before any request waits for it; the least of
    two more is what such a batch costs, {n: ms}, for the scheduler's batch sizes. Nothing
    where batches keep each session's bits (--batch-invariant) or the timed paths are not the CPU's."""
    lean = loaded.lean
    if lean is None or lean.batch_invariant or loaded.device.type != "cpu":
        return {}
    started = time.perf_counter()
    prompt = [(5 * i + 1) % loaded.vocab_size for i in range(16)]
    costs = {}
    for sessions in sorted({kernel_choices.bucket(n) for n in range(2, min(GATHERED_ROWS, max_sessions) + 1)}):
        seqs = [SequenceCache(loaded, prompt) for _ in range(sessions)]
        for seq in seqs:
            seq.prefill()
        times = []
        for _ in range(3):
            for seq in seqs:    # the same row again: a decode step taken back
                seq.cache.length = len(prompt) - 1
            begun = time.perf_counter()
            lean.batch([(torch.tensor(seq.tokens[-1:], device=loaded.device), seq.cache, 1) for seq in seqs])
            times.append((time.perf_counter() - begun) * 1e3)
        costs[sessions] = round(min(times[1:]), 3)
    log.info("kernels for batches of 2..%d sessions' rows timed in %.1f s; such a batch's ms by rows: %s",
             min(GATHERED_ROWS, max_sessions), time.perf_counter() - started,
             ", ".join(f"{n}: {ms:.1f}" for n, ms in costs.items()))
    return costs


CURVE_PREFIX = 128  # tokens cached before each timed forward: a short prompt's worth


def device_clock(device) -> Callable[[], float]:
    """time.perf_counter, after the device's queued work is done: a GPU runs kernels
    after their launch returns, so an unsynchronized clock reads launch time."""
    if device.type != "cuda":
        return time.perf_counter

    def clock() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()
    return clock


def measure_cost_curve(loaded: LoadedModel, rows: int, repeats: int = 3, prefills: int = 2) -> CostCurve:
    """The least ms of `repeats` forwards over 1..rows new rows after a CURVE_PREFIX-token
    prefix: what verifying γ = rows - 1 drafts costs, or a draft step (1 row).
    Rows are not free in every precision (int4 takes 4 a kernel pass), so the
    coordinator plans γ on this curve rather than on a line. And what the prefix's
    prefill cost per token: the coordinator weighs a drafter's prefill of a long
    prompt against what drafting can save (the least of `prefills`; 0: the prefix prefilled once, untimed)."""
    if rows <= 0:
        return CostCurve([], 0.0)
    ids = [(7 * i + 3) % loaded.vocab_size for i in range(CURVE_PREFIX + rows)]
    per_token = []
    clock = device_clock(loaded.device)
    for _ in range(max(prefills, 1)):
        seq = SequenceCache(loaded, ids[:CURVE_PREFIX])
        started = clock()
        seq.prefill()  # all but the last prefix token
        per_token.append((clock() - started) * 1e3 / (CURVE_PREFIX - 1))
    seq.forward([], keep_last=1)
    curve = []
    for n in range(1, rows + 1):
        times = []
        for _ in range(repeats):
            started = clock()
            seq.forward(ids[CURVE_PREFIX:CURVE_PREFIX + n], keep_last=n)
            times.append((clock() - started) * 1e3)
            seq.truncate(CURVE_PREFIX)  # the rollback a rejected draft gets
        curve.append(round(min(times), 3))  # the least disturbed: another process may share the cores
    return CostCurve(curve, round(min(per_token), 4) if prefills else 0.0)


def warm_and_time(loaded: LoadedModel, service_name: str, key: dict | None, cost_curve_rows: int,
                  prefill_chunk: int, max_sessions: int) -> tuple[CostCurve, dict[int, float]]:
    """Warm up, then the cost curve and the gathered batches' costs: a start profile's,
    saved under `key` by a start before, where a decode step timed now agrees with it
    (its kernel choices restored before warm-up, which would time them); else timed,
    with the prefill and gathered row buckets' kernel choices."""
    profile = start_profile.load(key) if key is not None else None
    if profile is not None:
        kernel_choices.restore_choices(profile.choices)
    torch_thread.run(warm_up, loaded)
    if profile is not None:
        decode_ms = torch_thread.run(measure_cost_curve, loaded, 1, prefills=0).forward_ms[0]
        saved = start_profile.path_for(key)
        if start_profile.holds(profile, decode_ms):
            log.info("%s: kernel choices and cost curves from %s (a decode step now %.1f ms, then %.1f ms)",
                     service_name, saved, decode_ms, profile.curve.forward_ms[0])
            return profile.curve, profile.gathered
        log.info("%s: a decode step now takes %.1f ms, %.1f ms when %s was saved: timing again",
                 service_name, decode_ms, profile.curve.forward_ms[0], saved)
        kernel_choices.restore_choices({})
        torch_thread.run(forget_prepared, loaded)
    torch_thread.run(time_prefill_buckets, loaded, prefill_chunk)
    gathered = torch_thread.run(time_gathered_buckets, loaded, max_sessions)
    return torch_thread.run(measure_cost_curve, loaded, cost_curve_rows), gathered


def forget_prepared(loaded: LoadedModel) -> None:
    """Drop the accelerated kernels' weights the layers made for restored choices
    (`kernel_choices.wanted`): the next call prepares every backend, to be timed again."""
    roots = loaded.lean.linears() if loaded.lean else [loaded.model]
    for root in roots:
        for module in root.modules():
            module.__dict__.pop("_accel", None)


def keep_dense_weights(loaded: LoadedModel, service_name: str) -> int:
    """--prefill-weights dense: the quantized layers hold their dense weight (bf16 or fp32,
    dense_rows.matmul_dtype) for calls of many rows."""
    if loaded.device.type != "cpu":
        return 0
    roots = loaded.lean.linears() if loaded.lean else [getattr(loaded.model, "model", loaded.model)]
    started = time.perf_counter()
    held = torch_thread.run(dense_rows.keep, roots)
    if held:
        log.info("%s: %.2f GB of dense weights kept for prefills (%.1f s; --prefill-weights unpack does without "
                 "them, and prefills unpack each layer per call)", service_name, held / 1e9,
                 time.perf_counter() - started)
    return held


def serve_model(servicer_cls: type, session_cls: type, add_to_server: Callable, service_name: str,
                loaded: LoadedModel, host: str = "127.0.0.1", port: int = 0, session_ttl_s: float = 600.0,
                max_sessions: int = 256, tls: ServerTls | None = None, uds: str | None = None,
                cost_curve_rows: int = 0, kv_cache_mb: float = 0.0, prefill_chunk: int = PREFILL_CHUNK,
                max_batch_rows: int = MAX_BATCH_ROWS, cost_curve: CostCurve | None = None,
                auth_token: str | None = None, prefill_weights: str = "dense",
                prefix_cache: str = "on", kernel_rows: int = 1, batch_invariant: bool = False,
                start_profile_setting: str = "on") -> RunningServer:
    """Start a model service; it reports SERVING only once the model is warm.
    `cost_curve`: publish this curve instead of timing one at warm-up (None: the
    one the environment pins, else timed over `cost_curve_rows` rows, and with it the
    prefill paths of every chunk's row bucket; with `start_profile_setting` "on", what an earlier
    start timed under the same key where it still holds, start_profile's)."""
    refuse_if_exposed(service_name, host, tls, uds, auth_token)
    kernel_choices.choose_at(kernel_rows)
    if loaded.lean is not None:
        loaded.lean.batch_invariant = batch_invariant
    if prefill_chunk < 1 or max_batch_rows < 1:
        raise ValueError(f"--prefill-chunk ({prefill_chunk}) and --max-batch-rows ({max_batch_rows}) must be >= 1")
    if prefill_weights == "dense":  # before the KV pool takes its share of what memory is left
        keep_dense_weights(loaded, service_name)
    store = SessionStore(ttl_s=session_ttl_s, max_sessions=max_sessions)
    store.start_reaper()
    pool = kv_pool(loaded, kv_cache_mb)
    scheduler = new_scheduler(loaded, max_batch_rows)
    prefix = PrefixCache(pool) if pool is not None and prefix_cache == "on" else None
    servicer = servicer_cls(loaded, session_cls, store, pool, scheduler, prefill_chunk, prefix)
    # A worker per session and a few spare, so health checks are answered under full load.
    running = start_server(lambda server: add_to_server(servicer, server), [service_name], host=host, port=port,
                           max_workers=max_sessions + 8, tls=tls, uds=uds, auth_token=auth_token)
    running.on_stop = store.close
    pinned = cost_curve or pinned_curve(service_name)
    gathered: dict[int, float] = {}
    if pinned or cost_curve_rows <= 0:
        torch_thread.run(warm_up, loaded)
        servicer.curve = pinned or torch_thread.run(measure_cost_curve, loaded, cost_curve_rows)
    else:  # the curve timed, with the prefill and gathered buckets, or what a start before timed
        key = start_profile.profile_key(loaded.identity, str(loaded.device), dict(
            service=service_name, kernel_rows=kernel_rows, batch_invariant=batch_invariant,
            cost_curve_rows=cost_curve_rows, max_sessions=min(max_sessions, GATHERED_ROWS),
            prefill_chunk=prefill_chunk, prefill_weights=prefill_weights))
        kept = start_profile_setting == "on"
        servicer.curve, gathered = warm_and_time(loaded, service_name, key if kept else None, cost_curve_rows,
                                                 prefill_chunk, max_sessions)
        if kept:
            def save_profile() -> None:  # at start, and at a clean stop with the choices made while serving
                start_profile.save(start_profile.StartProfile(servicer.curve, gathered, kernel_choices.saved_choices()),
                                   key)
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
                 max_batch_rows, prefill_chunk,
                 f"on ({prefix.block_tokens}-token blocks, within the pool)" if prefix else "off")
    running.set_serving(True)
    return running
