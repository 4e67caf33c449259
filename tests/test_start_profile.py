"""What a model service times at start, kept and reused at its next start (specdec.service.start_profile)."""
from __future__ import annotations

import json
import threading
import time

import pytest

import drafter.service
from specdec.runtime import kernel_choices
from specdec.runtime.quant import int4
from specdec.runtime.cost_curve import COST_CURVE_ENV, CostCurve
from specdec.rpc.serving import channel
from specdec.service import start_profile, warm_up
from specdec.v1 import common_pb2, drafter_pb2_grpc
from tests.test_lean import _tiny_int4_forward

KEY = {"model": "m", "service": "s"}


def test_a_profile_is_read_back_under_its_key_only(tmp_path, caplog):
    profile = start_profile.StartProfile(CostCurve([2.0, 3.5], 0.25), {2: 3.0, 8: 9.5},
                                         {("int4", 8, 4, "gathered", 2): "ggml", ("forward", "decode", "2x8", 0): "x"})
    path = start_profile.save(profile, KEY, tmp_path)
    back = start_profile.load(KEY, tmp_path)
    assert back == profile and path.parent == tmp_path
    assert start_profile.load({**KEY, "model": "other"}, tmp_path) is None
    path.write_text(json.dumps({**json.loads(path.read_text()), "key": {"model": "other"}}))
    assert start_profile.load(KEY, tmp_path) is None and "saved under another key" in caplog.text
    path.write_text("{ not json")
    assert start_profile.load(KEY, tmp_path) is None



def test_a_kernel_backend_installed_or_upgraded_since_a_start_is_timed_at_the_next(monkeypatch):
    """The key names each registered backend's package and version: a start after `pip install
    zentorch` times its kernels, where the profile kept without it would have hidden them."""
    from importlib import metadata
    installed = {module: names for module, names in metadata.packages_distributions().items() if module != "zentorch"}
    versions = {}
    real_version = metadata.version
    monkeypatch.setattr(metadata, "packages_distributions", lambda: installed)
    monkeypatch.setattr(metadata, "version", lambda name: versions.get(name) or real_version(name))

    def path():
        return start_profile.path_for(start_profile.profile_key("m", "cpu", {"service": "s"}))
    without = path()
    installed["zentorch"], versions["zentorch"] = ["zentorch"], "2.13.0.2"
    with_it = path()
    versions["zentorch"] = "2.13.1.0"
    assert len({without, with_it, path()}) == 3
    assert path() == path()

def test_a_profile_is_kept_per_instruction_set_in_force(monkeypatch):
    """torch held to another ISA (ATEN_CPU_CAPABILITY) on the same CPU, or a ggml built for
    other features at the same version: another profile, never the one timed before."""
    import subprocess
    import sys

    def key_in_child(**env) -> list[str]:
        code = ("from specdec.service import start_profile as s; k = s.profile_key('m', 'cpu', {}); "
                "print(k['isa']['torch'], s.path_for(k).name)")
        import os
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                             env={**os.environ, **env}, check=True)
        return out.stdout.split()
    scalar, native = key_in_child(ATEN_CPU_CAPABILITY="default"), key_in_child()
    assert scalar[0] == "DEFAULT" and native[0] != "DEFAULT", (scalar, native)
    assert scalar[1] != native[1]
    from specdec.runtime import ggml

    def path(features: str):
        monkeypatch.setattr(ggml, "isa", lambda: features)
        return start_profile.path_for(start_profile.profile_key("m", "cpu", {}))
    assert path("avx avx2 fma") != path("avx avx2 fma avx512 avx512_vnni")


def test_a_profile_holds_while_a_decode_step_takes_what_it_did():
    curve = CostCurve([30.0], 1.0)
    assert start_profile.holds(curve, 36.0) and start_profile.holds(curve, 24.0)
    assert not start_profile.holds(curve, 45.0) and not start_profile.holds(curve, 15.0)
    tiny = CostCurve([0.3], 0.01)
    assert start_profile.holds(tiny, 0.9) and not start_profile.holds(tiny, 2.0)   # the floor: noise, not a change


class FakeLoad:
    """The machine's load as a test sets it: other processes' share of the cores."""
    share = 0.0

    def others_share(self) -> float:
        return FakeLoad.share


@pytest.fixture
def machine(monkeypatch):
    FakeLoad.share = 0.0
    monkeypatch.setattr(start_profile, "MachineLoad", FakeLoad)
    return FakeLoad


def test_the_load_counts_other_processes_cpu_not_this_ones():
    """A thread of this process spinning is its own; a child process spinning is another's."""
    import multiprocessing
    import os
    spin_s = 0.6

    def spin() -> None:
        end = time.monotonic() + spin_s
        while time.monotonic() < end:
            pass
    own = start_profile.MachineLoad()
    spin()
    alone = own.others_share()
    other = start_profile.MachineLoad()
    child = multiprocessing.get_context("fork").Process(target=spin)
    child.start()
    child.join()
    cores = os.cpu_count() or 1
    assert alone < 0.5 / cores, alone                      # its own spinning is not counted
    assert other.others_share() > 0.6 / cores, cores       # a whole core of another process's is


def test_restored_choices_prepare_only_the_backends_they_name(monkeypatch, kernel_state):
    # A layer whose restored choices name torch's int4 kernel alone makes no other kernel's
    # weight (nor the int8 codes those would need); with no choices restored, it offers all.
    layer = _tiny_int4_forward().layers[0].gate_up
    layer.int8_activations = True
    offered = [b.name for b, _ in layer._accelerated()]
    key = ("int4", layer.out_features, layer.in_features)
    kernel_choices.restore_choices({(*key, 0): "torch-int4", (*key, "gathered", 2): "torch-int4"})
    layer.__dict__.pop("_accel")
    codes_made = []
    real = int4.per_row_int8
    monkeypatch.setattr(int4, "per_row_int8", lambda w: codes_made.append(w) or real(w))
    assert layer._accelerated() == [] and codes_made == []
    if offered:   # where a backend installs here: naming it brings it back, and it alone
        kernel_choices.restore_choices({(*key, 0): offered[-1]})
        layer.__dict__.pop("_accel")
        assert [b.name for b, _ in layer._accelerated()] == [offered[-1]]


def _info(running) -> common_pb2.ModelInfo:
    with channel(f"127.0.0.1:{running.port}") as ch:
        return drafter_pb2_grpc.DrafterStub(ch).Info(common_pb2.InfoRequest(), timeout=10)


def _start(loaded) -> common_pb2.ModelInfo:
    """A drafter started (its start profile kept or used), asked for its Info, stopped."""
    running = drafter.service.serve(loaded, cost_curve_rows=3)
    try:
        return _info(running)
    finally:
        running.stop(0)


def test_a_second_start_serves_on_what_the_first_timed_unless_the_machine_changed(tiny_draft, tmp_path,
                                                                                  monkeypatch, kernel_state,
                                                                                  machine):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    for variable in COST_CURVE_ENV.values():   # a pinned curve is not timed, so not kept
        monkeypatch.delenv(variable, raising=False)
    # The tiny draft's step is about 0.3 ms: within a full suite on 2 cores, every one of the
    # check's decode steps once took past its 1 ms floor. 5 ms still tells the slower
    # profile below (50x, and at least 20 ms) from this machine's.
    monkeypatch.setattr(start_profile, "CHECK_FLOOR_MS", 5.0)
    timed: list[str] = []
    real_gathered = warm_up.time_gathered_buckets

    def gathered(*args):
        timed.append("gathered")
        return real_gathered(*args)
    monkeypatch.setattr(warm_up, "time_gathered_buckets", gathered)

    def start() -> common_pb2.ModelInfo:
        return _start(tiny_draft)
    first = start()
    [path] = (tmp_path / "starts").glob("*.json")
    assert timed == ["gathered"] and len(first.forward_ms) == 3
    second = start()
    assert timed == ["gathered"]                      # not timed again
    assert list(second.forward_ms) == list(first.forward_ms)
    saved = json.loads(path.read_text())
    saved["forward_ms"] = [max(50.0 * ms, 20.0) for ms in saved["forward_ms"]]   # as if saved on a slower machine
    path.write_text(json.dumps(saved))
    third = start()
    assert timed == ["gathered", "gathered"]          # timed again, and kept; the old one set aside
    assert json.loads(path.read_text())["forward_ms"] == pytest.approx(list(third.forward_ms))
    assert third.forward_ms[0] < 50.0 * first.forward_ms[0] / 2
    assert json.loads(path.with_suffix(".aside.json").read_text())["forward_ms"] == saved["forward_ms"]


def test_a_start_on_a_busy_machine_serves_on_the_saved_profile_and_saves_nothing(tiny_draft, tmp_path, monkeypatch,
                                                                               kernel_state, machine):
    """Another stack loads the cores while the service restarts: its decode step disagrees
    with the profile because of them, so the profile serves as saved and nothing is timed;
    and a start with no profile that times under such load does not save what it timed."""
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    for variable in COST_CURVE_ENV.values():
        monkeypatch.delenv(variable, raising=False)
    timed: list[str] = []
    real_gathered = warm_up.time_gathered_buckets
    monkeypatch.setattr(warm_up, "time_gathered_buckets", lambda *a: timed.append("gathered") or real_gathered(*a))

    def start() -> common_pb2.ModelInfo:
        return _start(tiny_draft)
    machine.share = 0.9
    start()
    assert timed == ["gathered"] and not list((tmp_path / "starts").glob("*.json"))   # timed, not kept
    machine.share = 0.0
    first = start()
    [path] = (tmp_path / "starts").glob("*.json")
    saved = json.loads(path.read_text())
    saved["forward_ms"] = [ms / 100.0 for ms in saved["forward_ms"]]   # as if this machine were now much slower
    monkeypatch.setattr(start_profile, "CHECK_FLOOR_MS", 0.0)
    path.write_text(json.dumps(saved))
    machine.share = 0.9
    busy = start()
    assert timed == ["gathered", "gathered"]                      # not timed again under load
    assert list(busy.forward_ms) == pytest.approx(saved["forward_ms"])   # the saved curve serves
    assert json.loads(path.read_text())["forward_ms"] == saved["forward_ms"]   # and stays as it was
    assert len(first.forward_ms) == 3


def test_timings_that_disagree_with_themselves_are_not_kept(tiny_draft, tmp_path, monkeypatch, kernel_state,
                                                            machine):
    """The curve's one-row step and the decode step timed again at the end of the start
    disagree (the cores taken for a moment): served on, not saved."""
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    for variable in COST_CURVE_ENV.values():
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(start_profile, "CHECK_FLOOR_MS", 0.0)
    real_curve = warm_up.measure_cost_curve

    def curve(loaded, rows, *args, **kwargs):
        measured = real_curve(loaded, rows, *args, **kwargs)
        if rows > 1:   # the start's curve, timed slow
            return CostCurve([20.0 * ms for ms in measured.forward_ms], measured.prefill_ms_per_token)
        return measured
    monkeypatch.setattr(warm_up, "measure_cost_curve", curve)
    drafter.service.serve(tiny_draft, cost_curve_rows=3).stop(0)
    assert not list((tmp_path / "starts").glob("*.json"))


def test_no_profile_is_kept_when_the_setting_is_off(tiny_draft, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    for variable in COST_CURVE_ENV.values():
        monkeypatch.delenv(variable, raising=False)
    running = drafter.service.serve(tiny_draft, cost_curve_rows=2, start_profile_setting="off")
    running.stop(0)
    assert not list(tmp_path.glob("starts/*.json"))


def test_one_slow_decode_step_at_a_restart_does_not_throw_the_profile_away(tiny_draft, tmp_path, monkeypatch,
                                                                         kernel_state, machine):
    # The cores busy for a moment as the service restarts: its first timed step 50x the saved
    # one. The check tries again before timing everything anew.
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    for variable in COST_CURVE_ENV.values():
        monkeypatch.delenv(variable, raising=False)
    timed: list[str] = []
    real_gathered, real_curve = warm_up.time_gathered_buckets, warm_up.measure_cost_curve
    monkeypatch.setattr(warm_up, "time_gathered_buckets", lambda *a: timed.append("gathered") or real_gathered(*a))
    busy = []

    def curve(loaded, rows, *args, **kwargs):
        measured = real_curve(loaded, rows, *args, **kwargs)
        if rows == 1 and kwargs.get("prefills") == 0 and not busy:
            busy.append(True)
            return CostCurve([50.0 * ms for ms in measured.forward_ms], measured.prefill_ms_per_token)
        return measured
    monkeypatch.setattr(warm_up, "measure_cost_curve", curve)
    for _ in range(2):
        drafter.service.serve(tiny_draft, cost_curve_rows=3).stop(0)
    assert busy == [True] and timed == ["gathered"]   # the second start's check met the slow step, and held


def test_a_kernel_deferred_while_serving_is_made_within_a_poll_and_the_thread_ends_with_the_service(kernel_state):
    # A layer first called by a request (not at warm-up) defers its kernel then: the
    # service's thread makes it too, not only what warm-up deferred.
    stopped = threading.Event()
    thread = warm_up.prepare_deferred_kernels("test", stopped)
    later = kernel_choices.Deferred(lambda: "its weight")
    kernel_state.deferred.append(later)
    deadline = time.monotonic() + 10 * warm_up.DEFERRED_POLL_S
    while later.state is None and time.monotonic() < deadline:
        time.sleep(0.05)
    stopped.set()
    thread.join(5 * warm_up.DEFERRED_POLL_S)
    assert later.state == "its weight" and kernel_state.deferred == [] and not thread.is_alive()


def _made_within(deferred: kernel_choices.Deferred, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while deferred.state is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return deferred.state is not None


def test_a_deferred_kernel_waits_for_open_sessions_to_end_unless_they_stay_open_past_the_patience(kernel_state):
    # A forward arriving while a layer is made waits for it on the torch thread: a restart's
    # first request paid that in its prefill. So a layer is made once no session is open;
    # sessions open without a pause (sustained traffic) get it after the patience.
    open_sessions = ["a request in flight"]
    stopped = threading.Event()
    thread = warm_up.prepare_deferred_kernels("test", stopped, busy=lambda: bool(open_sessions), patience_s=3600)
    waiting = kernel_choices.Deferred(lambda: "its weight")
    kernel_state.deferred.append(waiting)
    assert not _made_within(waiting, 2 * warm_up.DEFERRED_POLL_S)   # past the poll that finds it: still waiting
    open_sessions.clear()
    assert _made_within(waiting, 10 * warm_up.DEFERRED_POLL_S)
    stopped.set()
    thread.join(5 * warm_up.DEFERRED_POLL_S)

    stopped = threading.Event()
    thread = warm_up.prepare_deferred_kernels("test", stopped, busy=lambda: True, patience_s=0.5)
    sustained = kernel_choices.Deferred(lambda: "its weight")
    kernel_state.deferred.append(sustained)
    assert _made_within(sustained, 10 * warm_up.DEFERRED_POLL_S)
    stopped.set()
    thread.join(5 * warm_up.DEFERRED_POLL_S)
    assert kernel_state.deferred == [] and not thread.is_alive()
