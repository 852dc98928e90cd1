"""`ModelEngine` on an untrained embedded-size pipeline: warmup, sessions, ticks and their records,
budget planning, cancellation, and the reasoner."""

import gc
import json
import logging
import re
import threading
import time
import weakref
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np
import pytest
import torch
from worker_hold import hold_worker

from policy_server.engine import api, sessions
from policy_server.engine.admission import Demand, admitted_slots, assign_slots
from policy_server.engine.engine import EngineSettings, ModelEngine
from policy_server.engine.warmup import Warmup
from policy_server.pipeline.policy import PolicyPipeline
from policy_server.pipeline.reasoner import ReasonerStream, generate
from policy_server.throttled_log import MAX_KEYS
from robots.embedded import build_random_pipeline


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    torch.set_num_threads(1)
    pipeline = build_random_pipeline(tmp_path_factory.mktemp("engine-model"), seed=1)
    engine = ModelEngine(pipeline, EngineSettings(warmup_ticks=2, max_sessions=3, default_budget_ms=10_000.0))
    assert not engine.ready()
    engine.start()
    assert engine.wait_ready(timeout_s=300)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def six_steps(tmp_path_factory):
    """A folder of the module's model (seed 1) sampling in 6 steps rather than 20, for the tests whose ticks run
    with every GEN-stack call stalled: a stalled tick then waits 6 stalls rather than 20. Each test loads its own
    pipeline from it (they hook its modules)."""
    folder = tmp_path_factory.mktemp("six-steps")
    build_random_pipeline(folder, seed=1)
    (folder / "policy.json").write_text(json.dumps({**json.loads((folder / "policy.json").read_text()),
                                                    "num_steps": 6}))
    return folder


def _observation(step=0, instruction=""):
    rng = np.random.default_rng(step)
    return api.Observation(images={"image": rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)},
                           state=np.array([0.2, 0.3], np.float32), instruction=instruction, step_index=step)


def test_info_describes_the_served_embodiment_and_warmup(engine):
    info = engine.info()
    assert [e.name for e in info.embodiments] == ["pusht"]
    spec = info.embodiments[0]
    assert spec.state_dim == 2 and spec.action.dim == 2
    assert spec.cameras[0].name == "image" and (spec.cameras[0].height, spec.cameras[0].width) == (64, 64)
    labels = [p.label for p in info.warmup_profile]
    assert labels == ["pusht/uncached", "pusht/max_caching"]
    uncached, cached = info.warmup_profile
    assert cached.skipped_calls > 0 and uncached.skipped_calls == 0


def test_generous_budget_runs_uncached_and_reports_the_tick(engine):
    session = engine.open_session("pusht", "reach the red circle", rate_hz=0)
    result = engine.act(session.session_id, session.epoch, _observation())
    assert result.actions.shape == (8, 2) and result.actions.dtype == np.float32
    assert np.all(np.abs(result.actions) <= 0.2 + 1e-6)  # clipped to the declared limits
    tick = result.tick
    assert tick.setting == "none" and tick.skipped_calls == 0
    assert tick.deadline_met
    assert set(tick.branches) == {"cond", "uncond"}
    assert tick.branches["cond"].sequence == "F" * engine.served.pipeline.config.num_steps
    assert {"prepare", "encode", "prefill", "denoise", "decode", "queue", "total"} <= set(tick.actual_ms)
    engine.close_session(session.session_id)


def test_tight_budget_caches_and_the_guard_keeps_the_deadline(engine):
    uncached_ms = engine.info().warmup_profile[0].p50_ms
    session = engine.open_session("pusht", "reach the blue circle", budget_ms=0.6 * uncached_ms, rate_hz=0)
    records = [engine.act(session.session_id, 1, _observation(i)).tick for i in range(4)]
    assert all(r.setting != "none" for r in records)
    assert all(r.skipped_calls > 0 for r in records)
    assert all(r.full_calls + r.skipped_calls == sum(len(b.sequence) for b in r.branches.values()) for r in records)
    engine.close_session(session.session_id)


def test_the_log_says_who_opened_closed_or_was_refused_each_session(engine, caplog):
    caplog.set_level(logging.INFO, logger="policy_server.engine")
    session = engine.open_session("pusht", "reach the red circle", rate_hz=0, client_name="arm 3")
    assert engine.session(session.session_id).client_name == "arm 3"
    engine.close_session(session.session_id)
    unnamed = engine.open_session("pusht", "reach the red circle", rate_hz=0)
    engine.close_session(unnamed.session_id)
    for _ in range(3):  # a client retrying in a loop: one line each 10 s
        with pytest.raises(api.BudgetInfeasible) as refused:
            engine.open_session("pusht", "reach the red circle", budget_ms=0.01, rate_hz=0, client_name="arm 4")
    opened, closed, opened_unnamed, closed_unnamed, refusal = [record.getMessage() for record in caplog.records]
    assert refusal == ("refused a session for 'arm 4': pusht, chunks of 8, budget 0.01 ms, 0 Hz: BUDGET_INFEASIBLE "
                       + refused.value.message)
    assert opened.startswith(f"opened session {session.session_id} ('arm 3'): pusht, chunks of 8, budget 10000 ms")
    assert closed == f"closed session {session.session_id} ('arm 3'): a CloseSession call closed it"
    assert opened_unnamed.startswith(f"opened session {unnamed.session_id}: pusht")
    assert closed_unnamed == f"closed session {unnamed.session_id}: a CloseSession call closed it"


def test_the_log_says_each_budget_change_and_refusal_once_per_session_each_10_s(engine, caplog):
    caplog.set_level(logging.INFO, logger="policy_server.engine")
    session = engine.open_session("pusht", "reach the red circle", rate_hz=0, client_name="arm 5")
    caplog.clear()
    engine.set_budget(session.session_id, 5000.0)
    engine.set_budget(session.session_id, 4000.0)  # a client changing it every tick: one line each 10 s
    for _ in range(2):
        with pytest.raises(api.BudgetInfeasible) as refused:
            engine.set_budget(session.session_id, 0.01)
    engine.close_session(session.session_id)
    changed, refusal, _closed = [record.getMessage() for record in caplog.records]
    assert changed.startswith(f"session {session.session_id} ('arm 5'): budget 10000 -> 5000 ms, slot ")
    assert refusal == (f"session {session.session_id} ('arm 5'): refused a budget of 0.01 ms, kept 4000 ms: "
                       f"BUDGET_INFEASIBLE {refused.value.message}")


def test_a_client_refused_in_a_loop_under_a_new_name_each_time_writes_few_lines(engine, caplog):
    caplog.set_level(logging.INFO, logger="policy_server.engine")
    for i in range(200):  # the name is the client's to choose: it must not pick a throttle of its own each time
        with pytest.raises(api.BudgetInfeasible):
            engine.open_session("pusht", "reach the red circle", budget_ms=0.01, rate_hz=0, client_name=f"arm-{i}")
    refusals = [record.getMessage() for record in caplog.records if record.getMessage().startswith("refused")]
    assert 1 <= len(refusals) <= MAX_KEYS + 1  # names followed at once, then one line for all the others


def test_a_tick_running_when_its_session_is_reset_answers_stale_epoch(engine):
    session = engine.open_session("pusht", "reach the red circle", seed=3, rate_hz=0)
    fresh = engine.open_session("pusht", "reach the red circle", seed=3, rate_hz=0)
    resets = []

    def reset_once(*_):  # the reset arrives while the tick runs its first GEN-stack call
        if not resets:
            resets.append(engine.reset_session(session.session_id))

    hook = engine.served.pipeline.transformer.norm_moe_gen.register_forward_pre_hook(reset_once)
    try:
        with pytest.raises(api.StaleEpoch):
            engine.act(session.session_id, 1, _observation(2))
    finally:
        hook.remove()
    # The new episode starts as a new session does: the stale tick counts in neither.
    assert np.array_equal(engine.act(session.session_id, 2, _observation(3)).actions,
                          engine.act(fresh.session_id, 1, _observation(3)).actions)
    for s in (session, fresh):
        engine.close_session(s.session_id)


def test_a_tick_ending_after_a_reset_teaches_the_finished_episode_not_the_new_one(engine, monkeypatch):
    """A reset that comes while a tick decodes its predicted frames, after its last epoch check: the tick is answered,
    and the full calls its gate wanted go to the finished episode's history, not into the new episode's (which the
    reset had just emptied, and whose ticks were then planned on the old episode's counts)."""
    uncached_ms = engine.info().warmup_profile[0].p50_ms
    session = engine.open_session("pusht", "reach the red circle", budget_ms=0.5 * uncached_ms, rate_hz=0,
                                  preview=True)
    decode = engine.served.pipeline.decode_video

    def reset_then_decode(latents):
        monkeypatch.setattr(engine.served.pipeline, "decode_video", decode)
        engine.reset_session(session.session_id)
        return decode(latents)

    monkeypatch.setattr(engine.served.pipeline, "decode_video", reset_then_decode)
    ran = engine.act(session.session_id, 1, _observation()).tick
    assert ran.setting != "none"  # planned with caching: the count it wanted is learned

    def learned(tick) -> Counter:
        structure = (engine.served.num_steps, int(tick.knobs["cfg_steps"]))
        return engine.sessions.get(session.session_id).history.tally(tick.setting, structure)

    assert learned(ran) == Counter()
    assert learned(engine.act(session.session_id, 2, _observation(1)).tick)  # the new episode's own tick teaches it
    engine.close_session(session.session_id)


def test_a_budget_changed_while_a_tick_runs_is_the_next_ticks_and_that_tick_records_the_one_it_ran_on(engine):
    uncached_ms = engine.info().warmup_profile[0].p50_ms
    session = engine.open_session("pusht", "reach the red circle", rate_hz=0)  # the default 10 s budget
    changed = []

    def change_once(*_):  # the new budget arrives while the tick runs its first GEN-stack call
        if not changed:
            changed.append(engine.set_budget(session.session_id, 0.6 * uncached_ms))

    hook = engine.served.pipeline.transformer.norm_moe_gen.register_forward_pre_hook(change_once)
    try:
        ran = engine.act(session.session_id, 1, _observation()).tick
    finally:
        hook.remove()
    new = changed[0]
    assert (ran.budget_ms, ran.deadline_ms, ran.knobs["slot_ms"]) == (10_000.0, 10_000.0, session.slot_ms)
    assert new.slot_ms < session.slot_ms
    following = engine.act(session.session_id, 1, _observation(1)).tick
    assert (following.budget_ms, following.deadline_ms, following.knobs["slot_ms"]) == (
        new.budget_ms, new.budget_ms, new.slot_ms)
    engine.close_session(session.session_id)


def test_same_seed_and_inputs_give_the_same_chunk(engine):
    first = engine.open_session("pusht", "reach the red circle", seed=7, rate_hz=0)
    second = engine.open_session("pusht", "reach the red circle", seed=7, rate_hz=0)
    a = engine.act(first.session_id, 1, _observation(3)).actions
    b = engine.act(second.session_id, 1, _observation(3)).actions
    assert np.array_equal(a, b)
    engine.close_session(first.session_id)
    engine.close_session(second.session_id)


def _queue_act(pool, engine, *args):
    """Submit `engine.act(*args)` on `pool` and wait until it is queued behind the held worker."""
    future = pool.submit(engine.act, *args)
    while engine.stats().queue_depth < 2:  # the gate and this tick
        time.sleep(0.005)
    return future


def _act_queued_together(engine, calls):
    """Hold the model worker until every `engine.act(*call)` has queued, then let them run; returns each
    call's result or exception."""
    gate = hold_worker(engine)

    def act(call):
        try:
            return engine.act(*call[:3], **call[3] if len(call) > 3 else {})
        except api.EngineError as error:
            return error

    with ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(act, call) for call in calls]
        while engine.stats().queue_depth < len(calls) + 1:  # the gate and the ticks
            time.sleep(0.005)
        gate.set()
        return [f.result() for f in futures]


def test_queued_ticks_of_one_shape_run_as_a_micro_batch_with_the_same_answers(engine):
    sessions = [engine.open_session("pusht", f"reach the {color} circle", seed=11, rate_hz=0)
                for color in ("red", "blue")]
    alone = [engine.act(s.session_id, 1, _observation(5)) for s in sessions]
    assert [r.tick.knobs["batch_size"] for r in alone] == [1, 1]
    for s in sessions:
        engine.reset_session(s.session_id)  # same seed and tick count again
    together = _act_queued_together(engine, [(s.session_id, 2, _observation(5)) for s in sessions])
    assert [r.tick.knobs["batch_size"] for r in together] == [2, 2]
    for single, batched in zip(alone, together, strict=True):
        np.testing.assert_allclose(batched.actions, single.actions, atol=1e-5)
        assert batched.tick.branches == single.tick.branches
    for s in sessions:
        engine.close_session(s.session_id)


def test_a_failing_tick_does_not_hold_up_its_micro_batch(engine):
    sessions = [engine.open_session("pusht", "reach the red circle", seed=s, rate_hz=0) for s in range(3)]
    calls = [(s.session_id, 1, _observation(s.seed)) for s in sessions]
    calls[1] = (*calls[1], {"should_abort": lambda: True})  # its caller goes away
    results = _act_queued_together(engine, calls)
    assert isinstance(results[1], api.Cancelled)
    assert all(r.actions.shape == (8, 2) and r.tick.knobs["batch_size"] == 3 for r in (results[0], results[2]))
    deadline = time.monotonic() + 10  # the worker counts the batch until its last thread is done
    while engine.stats().queue_depth and time.monotonic() < deadline:
        time.sleep(0.005)
    assert engine.stats().queue_depth == 0
    for s in sessions:
        engine.close_session(s.session_id)


def test_session_errors(engine):
    session = engine.open_session("pusht", "reach the red circle", rate_hz=0)
    with pytest.raises(api.UnknownSession):
        engine.act("nope", 1, _observation())
    reset = engine.reset_session(session.session_id)
    assert reset.epoch == 2
    with pytest.raises(api.StaleEpoch):
        engine.act(session.session_id, 1, _observation())
    with pytest.raises(api.UnknownEmbodiment):
        engine.open_session("unicycle", "go")
    with pytest.raises(api.BudgetInfeasible) as infeasible:
        engine.set_budget(session.session_id, 0.01)
    assert infeasible.value.best_achievable_ms > 0.01
    assert all(f"{stage} " in str(infeasible.value) for stage in ("encode", "denoise"))  # what the floor is made of
    others = [engine.open_session("pusht", "x", rate_hz=0, client_name=f"arm {i}") for i in range(2)]
    engine.session(session.session_id)  # the others go longest without a call, the first of them longest of all
    # A robot script that crashed left its sessions open: its restart is told when their places free themselves.
    idle_s = engine.settings.session_idle_s
    unused = (rf"close one first, or wait: a session with no call .* for {idle_s:g} s closes; the one longest without "
              r"a call \(client 'arm 0'\) has had none for \d+ s")
    with pytest.raises(api.TooManySessions, match=unused) as refused:
        engine.open_session("pusht", "one too many", rate_hz=0)
    assert others[0].session_id not in str(refused.value)  # the id is what a call on it needs: never to others
    for s in [session, *others]:
        engine.close_session(s.session_id)
    with pytest.raises(api.UnknownSession):
        engine.close_session(session.session_id)


def test_a_refusal_never_names_a_session_its_control_stream_holds_open_as_the_one_to_close(engine):
    arms = [engine.open_session("pusht", "x", rate_hz=0, client_name=f"arm {i}") for i in range(3)]
    with engine.attach(arms[0].session_id):  # its robot streams, however seldom: it never closes unused
        for arm in arms[1:]:
            engine.session(arm.session_id)  # arm 0 now goes longest without a call
        with pytest.raises(api.TooManySessions, match=r"the one longest without a call \(client 'arm 1'\)"):
            engine.open_session("pusht", "one too many", rate_hz=0)
        with engine.attach(arms[1].session_id), engine.attach(arms[2].session_id):
            with pytest.raises(api.TooManySessions,
                               match="closes; each open session is held by its Control stream or WebSocket connection"):
                engine.open_session("pusht", "one too many", rate_hz=0)
    for arm in arms:
        engine.close_session(arm.session_id)


def test_an_open_session_repeated_with_its_request_id_answers_the_same_session(engine, caplog):
    # A client retries OpenSession when the answer was lost: the retry, at the session limit too, gets the session the
    # first try opened, not a second one that would hold a place (or be refused) until the idle timeout.
    caplog.set_level(logging.INFO, logger="policy_server.engine")
    settings = {"budget_ms": 5_000.0, "rate_hz": 0.0, "client_name": "arm 1"}
    first = engine.open_session("pusht", "reach the red circle", request_id="r1", **settings)
    others = [engine.open_session("pusht", "x", rate_hz=0) for _ in range(2)]  # max_sessions=3: now full
    repeated = engine.open_session("pusht", "reach the red circle", request_id="r1", **settings)
    # Its slot as now shared with the two others, the rest as first answered.
    assert replace(repeated, slot_ms=first.slot_ms) == first and repeated.slot_ms < first.slot_ms
    assert engine.stats().sessions == 3
    assert [r.getMessage() for r in caplog.records].count(
        f"answered a repeated OpenSession (request id r1) with session {first.session_id} ('arm 1')") == 1
    # The id with other settings, another client's name among them, is refused without echoing the first's.
    for changed in ({"instruction": "reach the blue square"}, {"client_name": "arm 2"}):
        with pytest.raises(api.RequestIdReused) as reused:
            engine.open_session(**{"embodiment": "pusht", "instruction": "reach the red circle", "request_id": "r1",
                                   **settings, **changed})
        assert (reused.value.reason, reused.value.field) == ("REQUEST_ID_REUSED", "request_id")
        assert reused.value.got == f"other settings ({next(iter(changed))})", reused.value.got
        assert "red circle" not in str(reused.value) and "arm 1" not in str(reused.value)
    for session in [first, *others]:
        engine.close_session(session.session_id)
    again = engine.open_session("pusht", "reach the red circle", request_id="r1", **settings)  # r1's session closed
    assert again.session_id != first.session_id
    engine.close_session(again.session_id)


def test_a_session_takes_one_stream_at_a_time(engine):
    # Each Control stream holds server threads while it lasts: a session may not hold many.
    session = engine.open_session("pusht", "one stream", rate_hz=0)
    with engine.attach(session.session_id):
        with pytest.raises(api.StreamAttached) as refused, engine.attach(session.session_id):
            pass
        assert refused.value.retry_after_ms > 0
    with engine.attach(session.session_id):  # the first one ended
        engine.act(session.session_id, session.epoch, _observation())
    engine.close_session(session.session_id)


def test_sessions_with_no_call_for_the_idle_time_are_closed(engine, monkeypatch):
    # A client that went away without closing its sessions must not hold their places (3 here) for good.
    gone = engine.open_session("pusht", "left behind", rate_hz=0)
    kept = engine.open_session("pusht", "still here", rate_hz=0)
    streaming = engine.open_session("pusht", "between frames", rate_hz=0)
    monkeypatch.setattr(engine, "settings", replace(engine.settings, session_idle_s=1.0))
    with engine.attach(streaming.session_id):  # a Control stream holds its session however long it is quiet
        time.sleep(0.6)
        engine.session(kept.session_id)  # a call on it: its idle time starts again
        time.sleep(0.6)
        with pytest.raises(api.UnknownSession):
            engine.session(gone.session_id)  # asked for, an idle session is gone, not revived
        assert engine.capacity()[0].sessions_more == 1
        engine.session(kept.session_id)
        time.sleep(0.6)
        engine.session(kept.session_id)
        time.sleep(0.6)
        assert engine.capacity()[0].sessions_more == 1
        engine.session(kept.session_id)
    time.sleep(0.5)
    engine.session(kept.session_id)
    time.sleep(0.7)  # the stream ended 1.2 s ago: its session's idle time ran from there
    assert engine.capacity()[0].sessions_more == 2
    with pytest.raises(api.UnknownSession):
        engine.session(streaming.session_id)
    other = engine.open_session("pusht", "in their place", rate_hz=0)
    for session in (kept, other):
        engine.close_session(session.session_id)


@pytest.mark.parametrize("closed_by", ["client", "idle time"])
def test_a_closed_sessions_text_kv_is_freed_without_the_cyclic_collector(engine, monkeypatch, closed_by):
    # A session's last tick refers back to it. Left so, a closed session (its instruction's text K/V, 0.7 MB on the
    # embedded model) waited for Python's full collection, which runs seldom: a server grew 45 MB in 3000 sessions.
    monkeypatch.setattr(engine, "settings", replace(engine.settings, session_idle_s=0.2))
    text_kv = []
    gc.collect()
    gc.disable()
    try:
        for i in range(3):
            session = engine.open_session("pusht", "reach the red circle", rate_hz=0)
            engine.act(session.session_id, session.epoch, _observation(i))
            text_kv.append(weakref.ref(engine.sessions.get(session.session_id).prompt.und_kv["cond"].keys[0]))
            if closed_by == "client":
                engine.close_session(session.session_id)
            else:
                time.sleep(0.3)
                engine.capacity()  # closes the sessions idle for longer than their idle time
                with pytest.raises(api.UnknownSession):
                    engine.session(session.session_id)
        alive = [ref() is not None for ref in text_kv]
    finally:
        gc.enable()
    assert alive[:-1] == [False, False]  # the model worker may hold its last tick until the next one


def test_idle_sessions_are_closed_on_time_without_a_call(tmp_path):
    engine = ModelEngine(build_random_pipeline(tmp_path, seed=2),
                         EngineSettings(warmup_ticks=1, session_idle_s=0.4, compile_gen_stack=False))
    engine.start()
    try:
        assert engine.wait_ready(timeout_s=300)
        engine.open_session("pusht", "left behind", rate_hz=0)
        deadline = time.monotonic() + 5
        while engine.stats().sessions and time.monotonic() < deadline:  # stats() closes nothing itself
            time.sleep(0.05)
        assert engine.stats().sessions == 0
    finally:
        engine.close()


def test_a_call_naming_a_closed_or_expired_session_is_told_how_it_ended(engine, monkeypatch):
    # "no open session (closed, expired, or the server restarted)" left a robot's operator to guess which.
    closed = engine.open_session("pusht", "reach the red circle", rate_hz=0)
    engine.close_session(closed.session_id)
    with pytest.raises(api.UnknownSession) as told:
        engine.act(closed.session_id, 1, _observation())
    assert told.value.message == f"session {closed.session_id!r} was closed 0 s ago: a CloseSession call closed it"
    assert told.value.details() == {"session_id": closed.session_id, "session_end": "closed"}
    monkeypatch.setattr(engine, "settings", replace(engine.settings, session_idle_s=0.2))
    idle = engine.open_session("pusht", "reach the red circle", rate_hz=0)
    time.sleep(0.3)
    with pytest.raises(api.UnknownSession) as told:
        engine.session(idle.session_id)
    assert re.fullmatch(rf"session {idle.session_id!r} expired 0 s ago: no call for 0 s \(a session with no call "
                        r"for 0.2 s closes\)", told.value.message), told.value.message
    assert told.value.details()["session_end"] == "expired"
    with pytest.raises(api.UnknownSession) as told:
        engine.session("f" * 32)  # never opened here (or after a restart): the server cannot say more
    assert told.value.message == f"no open session {'f' * 32!r} (closed, expired, or the server restarted)"
    assert "session_end" not in told.value.details()
    monkeypatch.setattr(sessions, "REMEMBERED_CLOSURES", 2)  # the oldest closures are forgotten: memory stays bounded
    later = [engine.open_session("pusht", "reach the red circle", rate_hz=0) for _ in range(2)]
    for session in later:
        engine.close_session(session.session_id)
    with pytest.raises(api.UnknownSession, match="no open session"):
        engine.session(idle.session_id)
    with pytest.raises(api.UnknownSession, match="was closed"):
        engine.session(later[0].session_id)


def test_closing_a_session_tells_its_attached_stream_once_and_a_stream_cannot_attach_to_it_after(engine):
    session = engine.open_session("pusht", "reach the red circle", rate_hz=0)
    told = []
    with engine.attach(session.session_id, on_close=told.append):
        engine.close_session(session.session_id)
        assert [error.message for error in told] == [
            f"session {session.session_id!r} was closed 0 s ago: a CloseSession call closed it"]
    with pytest.raises(api.UnknownSession, match="was closed"), engine.attach(session.session_id, told.append):
        pass
    assert len(told) == 1


def test_a_session_closed_under_its_control_stream_ends_the_stream_once_with_not_found(engine):
    """A session closed by another call while its stream was open: the stream stayed open and answered every later
    frame with a SESSION_NOT_FOUND error event. It ends, once, saying what closed the session."""
    from policy_server.client import ControlStream, PolicyClient
    from policy_server.config import build_config
    from policy_server.server.app import build_server

    with build_server(build_config(overrides={"port": 0}), engine) as server, PolicyClient(server.target) as client:
        session = client.open_session("pusht", "reach the red circle", rate_hz=0)
        with ControlStream(client, session) as stream:
            stream.send({"image": np.zeros((64, 64, 3), np.uint8)}, np.zeros(2, np.float32), encoding="raw")
            assert stream.next_chunk(timeout_s=60).session_id == session.session_id
            client.close_session(session)
            closed = stream.next_event(timeout_s=10)
            assert closed.kind == "closed" and closed.error.code.name == "NOT_FOUND", closed
            assert closed.error.message == (f"session {session.session_id!r} was closed 0 s ago: a CloseSession call "
                                            "closed it")
            with pytest.raises(TimeoutError):
                stream.next_event(timeout_s=0.5)  # nothing after it: no reopening, no error events


def test_a_control_stream_holds_its_session_open_between_frames(engine, monkeypatch):
    from policy_server.client import ControlStream, PolicyClient
    from policy_server.config import build_config
    from policy_server.server.app import build_server

    monkeypatch.setattr(engine, "settings", replace(engine.settings, session_idle_s=0.5))
    with build_server(build_config(overrides={"port": 0}), engine) as server, PolicyClient(server.target) as client:
        session = client.open_session("pusht", "reach the red circle", rate_hz=0)
        with ControlStream(client, session, reconnect=False):
            time.sleep(1.0)
            assert engine.capacity()[0].sessions_more == 2
            assert engine.session(session.session_id).session_id == session.session_id
        time.sleep(1.0)
        assert engine.capacity()[0].sessions_more == 3  # the stream ended: closed as idle


def test_a_server_warns_when_its_default_budget_fits_no_session(engine, monkeypatch, caplog):
    from policy_server.config import build_config
    from policy_server.server.app import build_server

    monkeypatch.setattr(engine, "settings", replace(engine.settings, default_budget_ms=0.5))
    with caplog.at_level("WARNING", logger="policy_server.server.app"), \
            build_server(build_config(overrides={"port": 0, "latency_budget_ms": 0.5}), engine):
        for _ in range(100):
            if caplog.records:
                break
            time.sleep(0.02)
    assert [r.getMessage() for r in caplog.records] == [
        "the default budget of 0.5 ms fits no session on this device: an OpenSession without budget_ms will be "
        "refused; raise --latency-budget-ms (GetServerInfo's warmup profile gives the tick latencies)"]


def test_cancellation_and_expired_deadline(engine):
    session = engine.open_session("pusht", "reach the red circle", rate_hz=0)
    with pytest.raises(api.Cancelled):
        engine.act(session.session_id, 1, _observation(), should_abort=lambda: True)
    with pytest.raises(api.DeadlineExpired):
        engine.act(session.session_id, 1, _observation(), deadline_s=time.monotonic() - 1)
    # The session keeps serving after both.
    assert engine.act(session.session_id, 1, _observation()).actions.shape == (8, 2)
    engine.close_session(session.session_id)


def test_instruction_change_prefills_again(engine):
    session = engine.open_session("pusht", "reach the red circle", rate_hz=0)
    engine.act(session.session_id, 1, _observation())
    first = engine.sessions.get(session.session_id).prompt
    engine.act(session.session_id, 1, _observation(1))
    assert engine.sessions.get(session.session_id).prompt is first  # same instruction: K/V reused
    engine.act(session.session_id, 1, _observation(2, instruction="reach the green circle"))
    changed = engine.sessions.get(session.session_id).prompt
    assert changed is not first and changed.key[0] == "reach the green circle"
    assert engine.session(session.session_id).instruction == "reach the green circle"
    engine.close_session(session.session_id)


def test_a_session_seed_at_the_top_of_uint64_serves_every_tick(engine):
    """A tick draws its noise from the session's seed plus its tick count in the episode, which wraps as the
    wire's uint64 seed does (the second tick of seed 2**64 - 1 was an INTERNAL error)."""
    session = engine.open_session("pusht", "reach the red circle", seed=2**64 - 1, rate_hz=0)
    for step in range(2):
        assert engine.act(session.session_id, 1, _observation(step)).actions.shape == (8, 2)
    engine.close_session(session.session_id)


def test_reasoner_streams_text_and_bypasses_the_diffusion_cache(engine):
    pieces = list(engine.reason("describe the table", max_new_tokens=12, seed=0))
    again = list(engine.reason("describe the table", max_new_tokens=12, seed=0))
    assert pieces == again
    assert 0 < len(pieces) <= 12
    assert all(isinstance(p, str) and p for p in pieces)


def test_with_the_cache_off_every_call_runs_full(tmp_path):
    engine = ModelEngine(build_random_pipeline(tmp_path, seed=2), EngineSettings(warmup_ticks=1, diffusion_cache=False,
                                                                                  default_budget_ms=10_000.0))
    engine.start()
    try:
        assert engine.wait_ready(timeout_s=300)
        session = engine.open_session("pusht", "reach the red circle", rate_hz=0)
        tick = engine.act(session.session_id, 1, _observation()).tick
        steps = engine.info().num_steps
        assert tick.setting == "disabled" and tick.skipped_calls == 0 and tick.full_calls == 2 * steps
        assert {name: b.sequence for name, b in tick.branches.items()} == {"cond": "F" * steps, "uncond": "F" * steps}
    finally:
        engine.close()


def test_a_warmup_that_fails_is_logged_and_raised_by_wait_ready(tmp_path, monkeypatch, caplog):
    def shapes_that_fail(self):
        raise ValueError("a canvas the VAE cannot encode")

    monkeypatch.setattr(Warmup, "_warm_shapes", shapes_that_fail)
    engine = ModelEngine(build_random_pipeline(tmp_path, seed=2), EngineSettings(warmup_ticks=1))
    engine.start()
    try:
        with pytest.raises(RuntimeError, match="warmup failed") as raised:
            engine.wait_ready(timeout_s=300)
        assert isinstance(raised.value.__cause__, ValueError) and not engine.ready()
        failure = next(record for record in caplog.records if record.getMessage() == "warmup failed")
        assert failure.exc_info[1] is raised.value.__cause__  # the traceback is in the server's log
    finally:
        engine.close()


@pytest.mark.parametrize("mid_tick", [False, True], ids=["before its first tick", "in a tick"])
def test_closing_during_warmup_is_no_warmup_failure_to_log(tmp_path, caplog, mid_tick):
    # A server that cannot bind its port closes its engine so, wherever the warmup is.
    pipeline = build_random_pipeline(tmp_path, seed=2)
    engine = ModelEngine(pipeline, EngineSettings(warmup_ticks=1, compile_gen_stack=False))
    ticking = threading.Event()
    pipeline.transformer.norm_moe_gen.register_forward_pre_hook(lambda *_: ticking.set())
    engine.start()
    if mid_tick:
        assert ticking.wait(timeout=60)
    engine.close()
    with pytest.raises(RuntimeError):  # not warm, and never will be
        engine.wait_ready(timeout_s=60)
    assert not [record for record in caplog.records if record.getMessage() == "warmup failed"]


def test_close_answers_ticks_still_queued(tmp_path):
    pipeline = build_random_pipeline(tmp_path, seed=2)
    engine = ModelEngine(pipeline, EngineSettings(warmup_ticks=1))
    engine.start()
    assert engine.wait_ready(timeout_s=300)
    session = engine.open_session("pusht", "reach the red circle", rate_hz=0)
    gate = hold_worker(engine)
    with ThreadPoolExecutor(2) as pool:
        tick = _queue_act(pool, engine, session.session_id, 1, _observation())
        closing = pool.submit(engine.close)
        with pytest.raises(api.ShuttingDown):  # answered at once, not after the running step
            tick.result(timeout=60)
        gate.set()
        closing.result(timeout=60)
    with pytest.raises(api.ShuttingDown):
        engine.open_session("pusht", "reach the red circle")


def test_every_advertised_chunk_size_is_served(engine):
    spec = engine.info().embodiments[0]
    for chunk in range(spec.min_chunk_size, spec.max_chunk_size + 1):
        session = engine.open_session("pusht", "reach the red circle", chunk_size=chunk, rate_hz=0)
        result = engine.act(session.session_id, 1, _observation(chunk))
        assert result.actions.shape == (chunk, 2), chunk
        assert np.all(np.isfinite(result.actions))
        engine.close_session(session.session_id)


def test_a_second_tick_while_one_is_in_flight_is_refused(engine):
    session = engine.open_session("pusht", "reach the red circle", rate_hz=0)
    gate = hold_worker(engine)
    with ThreadPoolExecutor(1) as pool:
        first = _queue_act(pool, engine, session.session_id, 1, _observation())
        with pytest.raises(api.SessionBusy):
            engine.act(session.session_id, 1, _observation(1))
        gate.set()
        assert first.result(timeout=60).actions.shape == (8, 2)
    assert engine.act(session.session_id, 1, _observation(2)).actions.shape == (8, 2)
    engine.close_session(session.session_id)


def test_a_reserved_tick_holds_the_sessions_place_until_it_is_done_or_given_up(engine):
    session = engine.open_session("pusht", "reach the red circle", rate_hz=0)
    with engine.reserve_tick(session.session_id):  # the transport decodes the observation meanwhile
        with pytest.raises(api.SessionBusy):
            engine.act(session.session_id, 1, _observation())
    # Given up (its observation did not decode): the place is free again.
    with engine.reserve_tick(session.session_id) as reservation:
        result = engine.act(session.session_id, 1, _observation(1), reservation=reservation)
    assert result.actions.shape == (8, 2)
    assert engine.act(session.session_id, 1, _observation(2)).actions.shape == (8, 2)
    engine.close_session(session.session_id)
    limited = engine.open_session("pusht", "reach the red circle", rate_hz=0.01)
    with engine.reserve_tick(limited.session_id):
        pass  # a reservation given up still spent its token of the declared rate
    with engine.reserve_tick(limited.session_id):
        pass  # the burst of two
    with pytest.raises(api.RateExceeded):
        engine.act(limited.session_id, 1, _observation())
    engine.close_session(limited.session_id)


def test_a_busy_sessions_calls_are_refused_before_the_server_decodes_their_frames(engine, monkeypatch):
    from policy_server.client import PolicyClient, PolicyServerError
    from policy_server.config import build_config
    from policy_server.server import build_server, validate

    decoding, release = threading.Event(), threading.Event()
    decoded = []

    def slow_decode(*args, **kwargs):  # the first frame decodes until the test lets it
        decoded.append(args[1])
        if len(decoded) == 1:
            decoding.set()
            release.wait(30)
        return real_decode(*args, **kwargs)

    real_decode = validate.decode_image
    monkeypatch.setattr(validate, "decode_image", slow_decode)
    server = build_server(build_config(overrides={"port": 0}), engine).start()
    client = PolicyClient(server.target)
    session = client.open_session("pusht", "reach the red circle", rate_hz=0)
    frame = _observation().images["image"]
    try:
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(client.act, session, {"image": frame}, np.array([0.2, 0.3], np.float32))
            assert decoding.wait(30)
            for _ in range(3):
                with pytest.raises(PolicyServerError) as busy:
                    client.act(session, {"image": frame}, np.array([0.2, 0.3], np.float32))
                assert busy.value.reason == "SESSION_BUSY"
            release.set()
            assert first.result(60).actions.shape == (8, 2)
        assert len(decoded) == 1
    finally:
        release.set()
        client.close_session(session)
        client.close()
        server.stop(0.1)


def test_a_tick_of_a_session_closed_while_it_queues_or_runs_ends_without_a_chunk(engine):
    """A closed session's place goes to others at once, so its tick must not keep the worker: a client cycling
    OpenSession, Act, CloseSession kept a tick queued per cycle on one session's place, and the other sessions'
    ticks waited behind them all."""
    session = engine.open_session("pusht", "reach the red circle", rate_hz=0)
    gate = hold_worker(engine)
    with ThreadPoolExecutor(1) as pool:
        queued = _queue_act(pool, engine, session.session_id, 1, _observation())
        engine.close_session(session.session_id)
        gate.set()
        with pytest.raises(api.UnknownSession):
            queued.result(timeout=60)
    calls, closing = [], []

    def count(*_):  # each GEN-stack call; the first closes the session in `closing`
        calls.append(1)
        if closing and len(calls) == 1:
            engine.close_session(closing[0])

    hook = engine.served.pipeline.transformer.norm_moe_gen.register_forward_pre_hook(count)
    try:
        whole = engine.open_session("pusht", "reach the red circle", rate_hz=0)
        tick = engine.act(whole.session_id, 1, _observation()).tick  # the 10 s budget: every step runs its calls
        engine.close_session(whole.session_id)
        per_step = len(calls) // int(tick.knobs["num_steps"])
        running = engine.open_session("pusht", "reach the red circle", rate_hz=0)
        calls.clear()
        closing.append(running.session_id)
        with pytest.raises(api.UnknownSession):  # closed during its first step: it stops before the next
            engine.act(running.session_id, 1, _observation())
    finally:
        hook.remove()
    assert len(calls) == per_step


def test_a_tick_whose_caller_left_while_queued_is_withdrawn(engine):
    session = engine.open_session("pusht", "reach the red circle", rate_hz=0)
    gate = hold_worker(engine)
    gone = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        first = _queue_act(pool, engine, session.session_id, 1, _observation(), None, gone.is_set)
        gone.set()
        with pytest.raises(api.Cancelled):
            first.result(timeout=60)
        assert engine.stats().queue_depth == 1  # only the gate: the tick left the queue at once
        gate.set()
    assert engine.act(session.session_id, 1, _observation(1)).actions.shape == (8, 2)
    engine.close_session(session.session_id)


def test_ticks_faster_than_the_declared_rate_are_refused(engine):
    session = engine.open_session("pusht", "reach the red circle", rate_hz=0.5)
    assert session.rate_hz == 0.5
    for step in range(2):  # a burst of two absorbs jitter
        engine.act(session.session_id, 1, _observation(step))
    with pytest.raises(api.RateExceeded) as early:
        engine.act(session.session_id, 1, _observation(2))
    assert 0 < early.value.retry_after_ms <= 2000
    assert early.value.measured_hz > 0.5
    assert engine.session(session.session_id).measured_rate_hz == early.value.measured_hz
    engine.close_session(session.session_id)


def test_default_rate_comes_from_the_control_rate_and_the_actions_executed(engine):
    spec = engine.info().embodiments[0]
    session = engine.open_session("pusht", "reach the red circle", actions_per_chunk=4)
    assert session.rate_hz == pytest.approx(spec.control_hz / 4)
    engine.close_session(session.session_id)


def _floor_ms(engine) -> float:
    """The cheapest tick the planner can make: what BUDGET_INFEASIBLE reports."""
    with pytest.raises(api.BudgetInfeasible) as infeasible:
        engine.open_session("pusht", "reach the red circle", budget_ms=0.01, rate_hz=0)
    return infeasible.value.best_achievable_ms


def _budget_for_two(engine) -> float:
    """The smallest budget, in steps of a quarter of the cheapest tick, at which two sessions fit."""
    floor = _floor_ms(engine)
    return next(b for b in (floor * k / 4 for k in range(8, 40)) if engine.capacity(b, 0.0)[0].sessions_alone >= 2)


def test_admission_refuses_sessions_whose_ticks_could_not_all_meet_their_budgets(engine):
    budget = _budget_for_two(engine)
    capacity = engine.capacity(budget, 0.0)[0]
    assert (capacity.sessions_alone, capacity.sessions_more) == (2, 2)
    sessions = [engine.open_session("pusht", "reach the red circle", budget_ms=budget, rate_hz=0) for _ in range(2)]
    assert engine.capacity(budget, 0.0)[0].sessions_more == 0
    assert all(s.slot_ms <= budget / 2 for s in map(lambda s: engine.session(s.session_id), sessions))
    with pytest.raises(api.Overloaded, match="no session like this one fits beside them, 2 would") as refused:
        engine.open_session("pusht", "reach the red circle", budget_ms=budget, rate_hz=0)
    assert "the one longest without a call (no client_name) has had none" in str(refused.value)
    assert refused.value.sessions_fit == 2
    with pytest.raises(api.Overloaded):  # nor may a budget change squeeze the others
        engine.set_budget(sessions[0].session_id, 1.5 * _floor_ms(engine))
    for step, session in enumerate(sessions):  # the admitted ones are served within their budgets
        assert engine.act(session.session_id, 1, _observation(step)).tick.deadline_met
    engine.close_session(sessions[0].session_id)
    assert engine.capacity(budget, 0.0)[0].sessions_more == 1
    engine.close_session(sessions[1].session_id)


def test_declared_rates_must_fit_the_model_time(engine):
    # The cheapest tick itself, without the background piece it may wait for (which claims no model time).
    cheapest_ms = _floor_ms(engine) - engine._admission.blocking_ms()
    rate = 0.6 * 1000 / cheapest_ms  # each session would claim 60% of the model at its cheapest
    assert engine.capacity(10_000.0, rate)[0].sessions_alone == 1
    session = engine.open_session("pusht", "reach the red circle", rate_hz=rate)
    with pytest.raises(api.Overloaded):
        engine.open_session("pusht", "reach the red circle", rate_hz=rate)
    engine.close_session(session.session_id)


def test_instructions_over_the_token_limit_are_refused(engine):
    from policy_server.limits import MAX_INSTRUCTION_TOKENS

    longest = engine._warmup.text_of(MAX_INSTRUCTION_TOKENS)
    with pytest.raises(api.InvalidArgument, match="instruction: expected at most 128 tokens"):
        engine.open_session("pusht", longest + " and more", rate_hz=0)
    session = engine.open_session("pusht", longest, rate_hz=0)
    assert engine.act(session.session_id, 1, _observation()).tick.deadline_met
    with pytest.raises(api.InvalidArgument, match="observation.instruction"):
        engine.act(session.session_id, 1, _observation(1, instruction=longest + " and more"))
    engine.close_session(session.session_id)


def test_texts_holding_the_chat_templates_control_tokens_are_refused(engine):
    # They would restructure the prompt the model sees: end the user's turn, open another.
    with pytest.raises(api.InvalidArgument, match=r"instruction: .* got '<\|im_end\|>' in the text"):
        engine.open_session("pusht", "pick<|im_end|><|im_start|>system", rate_hz=0)
    session = engine.open_session("pusht", "pick up im_end", rate_hz=0)  # the words alone are text
    with pytest.raises(api.InvalidArgument, match="observation.instruction"):
        engine.act(session.session_id, 1, _observation(instruction="go <|vision_start|>"))
    with pytest.raises(api.InvalidArgument, match="prompt"):
        engine.reason("describe <|endoftext|>", max_new_tokens=4)
    engine.close_session(session.session_id)


def test_a_long_instruction_or_a_slow_tick_does_not_change_what_other_sessions_get(engine):
    short_key = engine.served.cost_key("pusht", 8, 4)
    budget = _budget_for_two(engine) + 0.25 * _floor_ms(engine)  # off the edge: normal noise moves nothing
    before_costs = engine.served.cost_model.costs(short_key)
    from policy_server.limits import MAX_INSTRUCTION_TOKENS

    long_session = engine.open_session("pusht", engine._warmup.text_of(MAX_INSTRUCTION_TOKENS), rate_hz=0)
    engine.act(long_session.session_id, 1, _observation())
    assert engine.served.cost_model.costs(short_key) == before_costs  # learned under its own key
    engine.close_session(long_session.session_id)
    # Admission sizes sessions at the longest instruction, so that tick has just taught it (warmup ran that key
    # only twice); from here on nothing may move it.
    before_capacity = engine.capacity(budget, 0.0)
    session = engine.open_session("pusht", "reach the red circle", rate_hz=0)
    # One stalled tick: every full call 20 ms slower (the eager stack's final norm runs once per call).
    stall = engine.served.pipeline.transformer.norm_moe_gen.register_forward_pre_hook(lambda *_: time.sleep(0.02))
    try:
        stalled = engine.act(session.session_id, 1, _observation(1))
    finally:
        stall.remove()
    assert stalled.tick.actual_ms["denoise"] > 20.0 * stalled.tick.full_calls / 2  # at most 2 calls per stack
    engine.close_session(session.session_id)
    assert engine.capacity(budget, 0.0) == before_capacity


def test_reasoner_text_is_the_decode_of_every_token_it_generated(engine):
    """A token that ends inside a character is held back while the next may complete it; the call's last one is
    flushed at the end, as transformers' TextStreamer does, so a call cut by max_new_tokens loses no text."""
    tokenizer = engine.served.pipeline.tokenizer
    stops = {tokenizer.eos_token_id, *tokenizer.special_token_ids.values()}
    prompt = "what is left of the cube?"
    ids = torch.tensor(tokenizer.tokenize(tokenizer.apply_chat_template([{"role": "user", "content": prompt}])))
    for max_new_tokens in (1, 2, 4, 8):
        tokens = [t for t in generate(engine.served.pipeline.transformer, ids, max_new_tokens, stop_token_ids=stops)
                  if t not in stops]
        assert "".join(engine.reason(prompt, max_new_tokens)) == tokenizer.decode(tokens), max_new_tokens


def _drain(pieces) -> tuple[str, api.ReasonEnd]:
    """A reasoner call's text, and how it ended (what its generator returns)."""
    text = ""
    while True:
        try:
            text += next(pieces)
        except StopIteration as ended:
            return text, ended.value


def test_a_reasoner_call_says_why_it_ended_and_how_many_tokens_it_generated(engine, monkeypatch):
    tokenizer = engine.served.pipeline.tokenizer
    prompt = "describe the table"
    ids = torch.tensor(tokenizer.tokenize(tokenizer.apply_chat_template([{"role": "user", "content": prompt}])))
    tokens = list(generate(engine.served.pipeline.transformer, ids, 6))
    text, end = _drain(engine.reason(prompt, 6))
    assert text == tokenizer.decode(tokens) and end == api.ReasonEnd("length", 6)
    # The same call with its third token as the model's end-of-text: it stops there, the token unsaid.
    said = tokens.index(tokens[2])
    monkeypatch.setattr(tokenizer, "eos_token_id", tokens[2])
    text, end = _drain(engine.reason(prompt, 6))
    assert text == tokenizer.decode(tokens[:said]) and end == api.ReasonEnd("stop", said)


def test_reasoner_sampling_at_a_vanishing_temperature_is_greedy(engine):
    greedy = list(engine.reason("describe the table", max_new_tokens=8, seed=0))
    for temperature in (1e-300, 5e-324):
        assert list(engine.reason("describe the table", max_new_tokens=8, temperature=temperature)) == greedy


def test_reasoner_stops_at_its_deadline_or_cancellation_even_during_a_long_prefill(engine):
    from policy_server.limits import MAX_PROMPT_TOKENS

    prompt = engine._warmup.text_of(MAX_PROMPT_TOKENS - 40)  # room for the chat template
    with pytest.raises(api.DeadlineExpired):
        list(engine.reason(prompt, max_new_tokens=256, deadline_s=time.monotonic() + 0.01))
    with pytest.raises(api.Cancelled):
        list(engine.reason(prompt, max_new_tokens=256, should_abort=lambda: True))
    with pytest.raises(api.InvalidArgument, match="prompt: expected at most"):
        engine.reason(prompt * 3, max_new_tokens=4)
    # Every call above gave its slot back.
    assert list(engine.reason("describe the table", max_new_tokens=4, seed=0))


def test_reasoner_calls_are_bounded_at_the_count_server_info_publishes(engine, monkeypatch):
    gate = hold_worker(engine)
    assert engine.info().max_reason_calls == 2
    running = [engine.reason("describe the table", max_new_tokens=12, seed=0) for _ in range(2)]
    transformer = engine.served.pipeline.transformer
    caches = []
    monkeypatch.setattr(transformer, "new_reasoner_cache",
                        lambda *args: caches.append(args) or type(transformer).new_reasoner_cache(transformer, *args))
    with pytest.raises(api.TooManyReasonCalls):
        engine.reason("describe the table", max_new_tokens=12, seed=0)
    assert not caches  # a refused call allocates no KV cache
    monkeypatch.undo()
    gate.set()
    answers = [list(stream) for stream in running]
    assert answers[0] and answers[0] == answers[1]  # both ran to their end
    assert list(engine.reason("describe the table", max_new_tokens=12, seed=0)) == answers[0]  # slots given back


def test_a_reasoner_call_that_fails_to_start_gives_its_place_back(engine):
    """A call refused by the stream's own checks (no server validated it here) or failing to allocate its KV
    cache leaves every place free."""
    for _ in range(engine.info().max_reason_calls + 1):
        with pytest.raises(ValueError, match="temperature must be >= 0"):
            engine.reason("describe the table", max_new_tokens=4, temperature=-1.0)
    streams = [engine.reason("describe the table", max_new_tokens=4, seed=0)
               for _ in range(engine.info().max_reason_calls)]  # every place is free again
    assert all(list(stream) for stream in streams)


def test_close_stops_a_running_reasoner_call_and_every_caller_is_answered(tmp_path):
    pipeline = build_random_pipeline(tmp_path, seed=3)
    engine = ModelEngine(pipeline, EngineSettings(warmup_ticks=1))
    engine.start()
    assert engine.wait_ready(timeout_s=300)
    from policy_server.limits import MAX_PROMPT_TOKENS

    stream = engine.reason(engine._warmup.text_of(MAX_PROMPT_TOKENS - 40), max_new_tokens=256)
    engine.close()
    with pytest.raises(api.ShuttingDown):
        list(stream)


def test_once_every_uncached_tick_fits_the_room_left_is_shared_and_a_lone_session_keeps_all_of_it():
    """Slots bound a tick's guard: a lone session (here asking 5 times a second) keeps its whole room, the budget
    less the background piece, as a tick was guarded at its budget before; two share what their uncached ticks leave.
    The rates' load counts the uncached ticks (a tick plans no more, whatever its slot), not the slots."""
    lone = Demand(budget_ms=300.0, rate_hz=5.0, floor_ms=50.0, ceiling_ms=150.0)
    assert assign_slots([lone], blocking_ms=10.0) == [290.0]
    other = Demand(budget_ms=400.0, rate_hz=1.0, floor_ms=20.0, ceiling_ms=60.0)
    assert assign_slots([lone, other], blocking_ms=10.0) == [190.0, 100.0]  # (290 - 150 - 60) / 2 = 40 more each
    assert assign_slots([lone, replace(other, ceiling_ms=200.0)], blocking_ms=10.0)[1] < 200.0  # no room: grown less


def test_sessions_admitted_before_the_background_piece_grew_keep_their_cheapest_ticks():
    """A lasting slowdown raises the background piece a tick may wait for (`CostModel.background_ms`) while sessions
    are open, and each opening, closing or new budget assigns their slots again: beside a piece they no longer fit
    with (`assign_slots` finds none), each keeps its cheapest tick, the least it was admitted with."""
    first = Demand(budget_ms=100.0, rate_hz=1.0, floor_ms=40.0, ceiling_ms=80.0)
    second = Demand(budget_ms=120.0, rate_hz=1.0, floor_ms=30.0, ceiling_ms=60.0)
    assert admitted_slots([first, second], blocking_ms=10.0) == assign_slots([first, second], blocking_ms=10.0)
    assert assign_slots([first, second], blocking_ms=50.0) is None
    assert admitted_slots([first, second], blocking_ms=50.0) == [40.0, 30.0]
    assert admitted_slots([], blocking_ms=50.0) == []


def test_a_tick_that_runs_past_its_slot_is_cut_there_so_the_tick_behind_it_meets_its_budget(engine):
    """Admission lets a tick wait for one tick of every other session, each within its slot. A slot that held the
    uncached tick was no cap: a tick slower than planned (a loaded machine) ran on to its own budget, 3 s here,
    and the session queued behind it, admitted at 1 s, missed its budget."""
    slow = engine.open_session("pusht", "reach the red circle", budget_ms=3000.0, rate_hz=0)
    other = engine.open_session("pusht", "reach the blue circle", budget_ms=1000.0, rate_hz=0, chunk_size=3)
    rows = {}
    for session in (slow, other):  # each one's GEN-stack rows (its chunk's), its prompt prefilled
        seen = engine.served.pipeline.transformer.norm_moe_gen.register_forward_pre_hook(
            lambda _, args, session=session: rows.update({session.session_id: args[0].shape[-2]}))
        try:
            engine.act(session.session_id, 1, _observation())
        finally:
            seen.remove()
    assert rows[slow.session_id] != rows[other.session_id]

    def stall(_, args):  # only the slow session's calls: 100 ms more each, 2 s over its 20 steps
        if args[0].shape[-2] == rows[slow.session_id]:
            time.sleep(0.1)

    hook = engine.served.pipeline.transformer.norm_moe_gen.register_forward_pre_hook(stall)
    gate = hold_worker(engine)
    try:
        with ThreadPoolExecutor(2) as pool:
            slowed = _queue_act(pool, engine, slow.session_id, 1, _observation(1))
            behind = pool.submit(engine.act, other.session_id, 1, _observation(2))
            while engine.stats().queue_depth < 3:  # the gate and both ticks, the slow one first
                time.sleep(0.005)
            gate.set()
            slowed, behind = slowed.result(timeout=60).tick, behind.result(timeout=60).tick
    finally:
        gate.set()
        hook.remove()
        for session in (slow, other):
            engine.close_session(session.session_id)
    assert behind.deadline_met, (behind.actual_ms, slowed.actual_ms)
    # Its guard skipped calls, or gave up steps, to end within its slot.
    assert slowed.forced_skips or any(f.startswith("late_") for f in slowed.fallbacks), slowed


def test_ticks_that_run_as_a_micro_batch_may_hold_the_worker_for_their_slots_together(engine):
    """On a CPU a micro-batch's calls cost about what its ticks' cost one by one, so each of three ticks run
    together advances at a third of the worker. Each was held to its own slot from the batch's start, and gave up
    steps though the three slots held all three ticks one after another; the batch may take the three slots."""

    def stall(_, args):  # every GEN-stack call 30 ms more per item it stacks, as a CPU costs a batch
        time.sleep(0.03 * (args[0].shape[0] if args[0].dim() == 3 else 1))

    sessions = [engine.open_session("pusht", "reach the red circle", rate_hz=0) for _ in range(3)]
    try:
        for session in sessions:  # their prompts prefilled, as a running session's are
            engine.act(session.session_id, 1, _observation())
        hook = engine.served.pipeline.transformer.norm_moe_gen.register_forward_pre_hook(stall)
        try:
            alone = engine.act(sessions[0].session_id, 1, _observation(1)).tick  # 1.2 s of stalls over 20 steps
            slot_ms = 1.6 * (alone.actual_ms["total"] - alone.actual_ms["queue"])
            budget = engine._admission.blocking_ms() + 3 * slot_ms  # three slots, each holding that tick
            for session in sessions:
                engine.set_budget(session.session_id, budget)
            assert all(engine.session(s.session_id).slot_ms == pytest.approx(slot_ms) for s in sessions)
            ticks = [r.tick for r in _act_queued_together(engine, [(s.session_id, 1, _observation(2))
                                                                   for s in sessions])]
        finally:
            hook.remove()
    finally:
        for session in sessions:
            engine.close_session(session.session_id)
    assert not any(alone.fallbacks) and alone.forced_skips == 0
    assert [t.knobs["batch_size"] for t in ticks] == [3, 3, 3]
    assert all(not t.fallbacks and t.forced_skips == 0 for t in ticks), [
        (t.fallbacks, t.forced_skips, t.actual_ms["denoise"]) for t in ticks]


def test_a_tick_is_judged_against_its_budget_from_arrival(engine):
    session = engine.open_session("pusht", "reach the red circle", budget_ms=2000.0, rate_hz=0)
    gate = hold_worker(engine)
    with ThreadPoolExecutor(1) as pool:
        queued = _queue_act(pool, engine, session.session_id, 1, _observation())
        time.sleep(0.3)  # the tick waits in the queue; the wait counts once, in its total
        gate.set()
        tick = queued.result(timeout=60).tick
    assert tick.deadline_ms == 2000.0 and tick.actual_ms["queue"] >= 300.0
    assert tick.deadline_met == (tick.actual_ms["total"] <= 2000.0) and tick.deadline_met
    caller = engine.act(session.session_id, 1, _observation(1), deadline_s=time.monotonic() + 1.5).tick
    assert 1400.0 < caller.deadline_ms <= 1500.0  # the caller's deadline is the tighter one
    engine.close_session(session.session_id)


def test_a_ticks_frames_go_on_their_canvas_on_the_callers_thread_not_the_model_workers(engine, monkeypatch):
    """The worker every session shares spends only the canvas's VAE encode on a tick's frames, whatever their
    size: a 2048 px frame is resized while the worker is held, and its time is its own tick's, not learned."""
    pipeline = engine.served.pipeline
    prepared_on = []

    def prepare_images(embodiment, images):
        frames = type(pipeline).prepare_images(pipeline, embodiment, images)
        prepared_on.append(threading.current_thread())
        return frames

    monkeypatch.setattr(pipeline, "prepare_images", prepare_images)
    session = engine.open_session("pusht", "reach the red circle", rate_hz=0)
    large = api.Observation(images={"image": np.random.default_rng(0).integers(0, 256, (2048, 2048, 3), np.uint8)},
                            state=np.array([0.2, 0.3], np.float32))
    callers = []

    def act():
        callers.append(threading.current_thread())
        return engine.act(session.session_id, 1, large)

    gate = hold_worker(engine)
    with ThreadPoolExecutor(1) as pool:
        queued = pool.submit(act)
        while engine.stats().queue_depth < 2:  # the gate and the tick, whose frames are then on their canvas
            time.sleep(0.005)
        prepared_while_held = list(prepared_on)
        gate.set()
        tick = queued.result(timeout=60).tick
    assert prepared_while_held == callers
    assert tick.actual_ms["prepare"] > 0 and tick.deadline_met
    tokens = engine.served.instruction_tokens("reach the red circle", "instruction")
    learned = engine.served.cost_model.samples(engine.served.cost_key("pusht", session.chunk_size, tokens))
    assert "encode" in learned and "prepare" not in learned
    engine.close_session(session.session_id)


def test_a_reasoner_call_is_answered_at_its_deadline_even_while_ticks_hold_the_worker(engine):
    gate = hold_worker(engine)  # stands in for a worker busy with ticks: no background step runs
    started = time.monotonic()
    with pytest.raises(api.DeadlineExpired):
        list(engine.reason("describe the table", max_new_tokens=8, deadline_s=started + 0.2))
    assert time.monotonic() - started < 5
    gate.set()
    assert list(engine.reason("describe the table", max_new_tokens=4, seed=0))  # its slot was given back


def test_dynamics_calls_are_off_unless_asked_for(engine):
    """`max_dynamics_calls` 0 (the default): refused with DYNAMICS_OFF, and admission reserves nothing for them."""
    assert engine.info().max_dynamics_calls == 0
    session = engine.open_session("pusht", "reach the red circle", rate_hz=0)
    try:
        with pytest.raises(api.DynamicsOff, match="--max-dynamics-calls"):
            engine.forward_dynamics(session.session_id, session.epoch, _observation(),
                                    np.zeros((session.chunk_size, 2), np.float32))
    finally:
        engine.close_session(session.session_id)


def test_warmup_measures_the_ends_and_defaults_and_interpolates_between(engine):
    """Chunks 1..16 make 1..5 latent frames; warmup runs 1, 3 (the default chunk 8) and 5 and puts 2 and 4 on
    the chord between their neighbours, so every shape a session may ask for has costs. On an engine of its own:
    the module's has ticked every chunk size since, which replaces the chords by what those ticks measured."""
    fresh = ModelEngine(engine.served.pipeline, EngineSettings(warmup_ticks=1, max_sessions=3))
    fresh.start()
    try:
        assert fresh.wait_ready(timeout_s=300)
        _check_chords(fresh)
        # Skipped calls are timed on every measured shape, also where the gate cannot skip (chunk 3: no noisy
        # vision), so a tight tick's guard counts on cheap skips there as well.
        model = fresh.served.cost_model
        for chunk in (3, 8, 16):
            key = fresh.served.cost_key("pusht", chunk, 0)
            assert model.samples(key)["skip"] > 0 and model.costs(key).skip_ms < model.costs(key).full_ms
    finally:
        fresh.close()


def _check_chords(engine) -> None:
    model = engine.served.cost_model
    for tokens in (0, 100):
        keys = {frames: engine.served.cost_key("pusht", chunk, tokens) for frames, chunk in
                ((1, 3), (2, 5), (3, 8), (4, 12), (5, 16))}
        assert all(model.is_warm(key) for key in keys.values())
        for between, (low, high) in ((2, (1, 3)), (4, (3, 5))):
            costs, a, b = model.costs(keys[between]), model.costs(keys[low]), model.costs(keys[high])
            assert min(a.full_ms, b.full_ms) <= costs.full_ms <= max(a.full_ms, b.full_ms)
            assert set(costs.fixed_ms) == set(a.fixed_ms) & set(b.fixed_ms)


def test_one_preempted_run_of_a_background_piece_does_not_set_the_reserve(tmp_path, monkeypatch):
    """Every admission adds the longest background piece a tick may find running. One timed run of the reasoner
    set it, so a piece that another process preempted once (a server warming up beside other work) raised every
    session's floor by the stall until an idle retiming."""
    step, streams = ReasonerStream.step, []

    def preempted_once(stream):
        if stream not in streams:
            streams.append(stream)
            if len(streams) == 2:  # the first step of the first timed call (the first call is untimed)
                time.sleep(0.5)
        return step(stream)

    monkeypatch.setattr(ReasonerStream, "step", preempted_once)
    engine = ModelEngine(build_random_pipeline(tmp_path, seed=1),
                         EngineSettings(warmup_ticks=1, compile_gen_stack=False))
    engine.start()
    try:
        assert engine.wait_ready(timeout_s=300)
    finally:
        engine.close()
    assert len(streams) > 2 and engine._admission.blocking_ms() < 500.0


def test_an_idle_server_times_its_ticks_again_before_refusing_a_budget_as_infeasible(six_steps, caplog):
    caplog.set_level(logging.INFO, logger="policy_server.engine.admission")
    # A warmup that ran while something else held the machine: every GEN-stack call 50 ms slower.
    pipeline = PolicyPipeline.from_pretrained(six_steps)
    engine = ModelEngine(pipeline, EngineSettings(warmup_ticks=1, max_sessions=2, default_budget_ms=60_000.0,
                                                  compile_gen_stack=False))
    stall = pipeline.transformer.norm_moe_gen.register_forward_pre_hook(lambda *_: time.sleep(0.05))
    engine.start()
    try:
        assert engine.wait_ready(timeout_s=300)
        stall.remove()
        retimed = "timing these ticks again"
        first = engine.open_session("pusht", "reach the red circle", rate_hz=0)
        with pytest.raises(api.BudgetInfeasible) as refused:  # with a session open, on the warmup's timings
            engine.open_session("pusht", "reach the red circle", budget_ms=0.01, rate_hz=0)
        stalled_floor_ms = refused.value.best_achievable_ms
        assert stalled_floor_ms > 100.0 and retimed not in caplog.text  # at least two full calls
        engine.close_session(first.session_id)
        with pytest.raises(api.BudgetInfeasible):  # out of reach however busy the warmup was: not timed again
            engine.open_session("pusht", "reach the red circle", budget_ms=stalled_floor_ms / 20, rate_hz=0)
        assert retimed not in caplog.text

        budget_ms = stalled_floor_ms - 50.0  # half the stall's share, the rest for noise
        # GetServerInfo's capacity answers on the timings at hand; an opening at that budget times the ticks again
        # and opens on the new timings, which capacity then reports too.
        (capacity,) = [c for c in engine.capacity(budget_ms) if c.embodiment == "pusht"]
        assert capacity.sessions_alone == 0 and retimed not in caplog.text
        session = engine.open_session("pusht", "reach the red circle", budget_ms=budget_ms, rate_hz=0)
        assert caplog.text.count(retimed) == 1
        (capacity,) = [c for c in engine.capacity(budget_ms) if c.embodiment == "pusht"]
        assert capacity.sessions_alone >= 1
        assert engine.act(session.session_id, 1, _observation()).tick.deadline_met
        engine.close_session(session.session_id)
        with pytest.raises(api.BudgetInfeasible) as refused:
            engine.open_session("pusht", "reach the red circle", budget_ms=0.01, rate_hz=0)
        floor_ms = refused.value.best_achievable_ms
        assert floor_ms <= budget_ms
        with pytest.raises(api.BudgetInfeasible):  # timed again once a minute at most
            engine.open_session("pusht", "reach the red circle", budget_ms=floor_ms / 2, rate_hz=0)
        assert caplog.text.count(retimed) == 1
    finally:
        engine.close()


def test_timing_ticks_again_at_a_busy_moment_does_not_raise_the_least_budget(tmp_path, monkeypatch):
    """An idle server times a shape's ticks and the background pieces again before refusing a budget below its
    cheapest tick, to undo timings a busy moment inflated. The new timings replaced the old ones, so a retiming that
    another process slowed raised the least budget every later session is held to: a client's 10 ms budget, retimed
    beside other work, took a server's from 63.7 to 181.9 ms, refusing its own default 120 ms budget."""
    pipeline = build_random_pipeline(tmp_path, seed=1)
    engine = ModelEngine(pipeline, EngineSettings(warmup_ticks=1, max_sessions=2, compile_gen_stack=False))
    engine.start()
    try:
        assert engine.wait_ready(timeout_s=300)
        with pytest.raises(api.BudgetInfeasible) as refused:  # far below the cheapest tick: not timed again
            engine.open_session("pusht", "reach the red circle", budget_ms=0.01, rate_hz=0)
        least_ms = refused.value.best_achievable_ms
        # Another process takes the machine while the ticks and pieces are timed again: every GEN-stack call and
        # reasoner step 50 ms slower.
        stalled = []
        stall = pipeline.transformer.norm_moe_gen.register_forward_pre_hook(
            lambda *_: stalled.append(time.sleep(0.05)))
        step = ReasonerStream.step
        monkeypatch.setattr(ReasonerStream, "step", lambda stream: (time.sleep(0.05), step(stream))[1])
        with pytest.raises(api.BudgetInfeasible) as refused:
            engine.open_session("pusht", "reach the red circle", budget_ms=least_ms / 2, rate_hz=0)
        stall.remove()
        monkeypatch.setattr(ReasonerStream, "step", step)
        assert stalled  # the ticks were timed again, at the busy moment
        # Not one stalled call more (the cheapest tick has two and a piece ahead of it; before, +149 ms here). Each
        # cost keeps its lower median, and the planner adds its deviation, which the kept samples may set a fraction
        # of a ms wider.
        assert refused.value.best_achievable_ms < least_ms + 50.0
        with pytest.raises(api.BudgetInfeasible) as refused:
            engine.open_session("pusht", "reach the red circle", budget_ms=0.01, rate_hz=0)
        assert refused.value.best_achievable_ms < least_ms + 50.0
    finally:
        engine.close()


def test_a_lasting_slowdown_raises_the_background_reserve_and_its_end_lowers_it(six_steps):
    """Admission adds to every tick's wait the longest background piece it may find running (a reasoner step, a
    dynamics piece). Timed at warmup, it only ever went down (at a retiming), so on a machine that stayed slower
    (a GPU throttling, another process) admission kept promising ticks a wait the worker could no longer keep. It
    now moves with the live ticks' speed against the warmup's: one slow tick does not move it, a lasting slowdown
    raises it, and its end lowers it again. (Its stalls, per call, set the ratio below whatever the step count.)"""
    pipeline = PolicyPipeline.from_pretrained(six_steps)
    engine = ModelEngine(pipeline, EngineSettings(warmup_ticks=1, compile_gen_stack=False))
    engine.start()
    try:
        assert engine.wait_ready(timeout_s=300)
        session = engine.open_session("pusht", "reach the red circle", budget_ms=2000.0, rate_hz=0)  # uncached ticks
        quiet_ms = engine._admission.blocking_ms()
        least_ms = _floor_ms(engine)
        # Another process takes the machine: every GEN-stack call 40 ms slower (several times its cost here).
        stall = pipeline.transformer.norm_moe_gen.register_forward_pre_hook(lambda *_: time.sleep(0.04))
        engine.act(session.session_id, 1, _observation(0))
        assert engine._admission.blocking_ms() == pytest.approx(quiet_ms)  # one slow tick is one sample of 32
        for step in range(1, 18):
            engine.act(session.session_id, 1, _observation(step))
        slow_ms = engine._admission.blocking_ms()
        assert slow_ms > 3 * quiet_ms
        # What a client is told: the least budget grew by as much (the cheapest tick's own costs are the longest
        # instruction's, which these ticks do not teach).
        assert _floor_ms(engine) == pytest.approx(least_ms - quiet_ms + slow_ms)
        stall.remove()
        for step in range(20):
            engine.act(session.session_id, 1, _observation(step))
        assert engine._admission.blocking_ms() < slow_ms / 2
    finally:
        engine.close()


def test_capacity_answers_while_an_idle_server_times_its_ticks_again(tmp_path):
    """GetServerInfo's capacity answers on the timings at hand: it took the lock an opening holds while the ticks are
    timed again, so every GetServerInfo waited for the retiming (1.6 s on a server whose budget_ms=10 opening
    retimed, plain GetServerInfo included, which reports the capacity at the default budget)."""
    pipeline = build_random_pipeline(tmp_path, seed=1)
    engine = ModelEngine(pipeline, EngineSettings(warmup_ticks=1, max_sessions=2, compile_gen_stack=False))
    engine.start()
    retiming, release = threading.Event(), threading.Event()

    def held(*_):
        retiming.set()
        release.wait()

    try:
        assert engine.wait_ready(timeout_s=300)
        with pytest.raises(api.BudgetInfeasible) as refused:  # far below the cheapest tick: not timed again
            engine.open_session("pusht", "reach the red circle", budget_ms=0.01, rate_hz=0)
        hold = pipeline.transformer.norm_moe_gen.register_forward_pre_hook(held)
        with ThreadPoolExecutor(2) as pool:
            opening = pool.submit(engine.open_session, "pusht", "reach the red circle",
                                  budget_ms=refused.value.best_achievable_ms / 2, rate_hz=0)
            assert retiming.wait(timeout=60)
            capacity = pool.submit(engine.capacity)
            try:
                (answer,) = capacity.result(timeout=30)  # the retiming is held until released
                assert answer.sessions_alone >= 1 and not opening.done()
            finally:
                hold.remove()
                release.set()
            with pytest.raises(api.BudgetInfeasible):
                opening.result()
    finally:
        release.set()
        engine.close()
