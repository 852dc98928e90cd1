"""The model worker's loop: ticks first, background work one step at a time, shutdown answers everyone."""

from __future__ import annotations

import threading
import time

import pytest

from policy_server.engine import api
from policy_server.engine.call_end import CallEnd
from policy_server.engine.worker import GeneratorJob, ModelWorker, TickJob


class _Log:
    def __init__(self):
        self.events: list[str] = []
        self.lock = threading.Lock()

    def add(self, event: str) -> None:
        with self.lock:
            self.events.append(event)


def _until(condition, timeout_s: float = 10.0) -> None:
    """Wait for ``condition()``; fail the test, not hang it, when it never holds."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the worker never got there"
        time.sleep(0.001)


def _worker(log: _Log, max_batch: int = 1) -> ModelWorker:
    def tick_steps(job: TickJob, batch: list[TickJob]):
        log.add(f"tick {job.payload}")
        return job.payload
        yield  # a tick is a generator; this one makes no model call

    def no_stack(gen, und_kv):
        raise AssertionError("these ticks make no GEN-stack call")

    return ModelWorker(tick_steps, no_stack, max_batch)


def _steps(log: _Log, name: str, count: int, gate: threading.Event | None = None,
           started: threading.Event | None = None):
    for index in range(count):
        if gate is not None and index == 0:
            if started is not None:
                started.set()
            gate.wait()
        log.add(f"{name} step {index}")
        yield


def test_ticks_run_between_the_steps_of_background_work():
    log, gate, started = _Log(), threading.Event(), threading.Event()
    worker = _worker(log)
    worker.submit(GeneratorJob(_steps(log, "reason", 3, gate, started), lambda error: None))
    worker.submit(GeneratorJob((x for x in ()), lambda error: None))  # a marker: runs after the first step
    ticks = [TickJob(session=object(), shape="s", payload=i) for i in range(2)]
    started.wait()
    for tick in ticks:
        worker.submit(tick)
    gate.set()  # the reasoner's first step was running; both ticks come before its next one
    assert [t.result.result(timeout=10) for t in ticks] == [0, 1]
    worker.submit(GeneratorJob(_steps(log, "end", 1), lambda error: None))
    _until(lambda: len(log.events) >= 6)
    assert log.events[:3] == ["reason step 0", "tick 0", "tick 1"]
    assert log.events[3:5] == ["reason step 1", "reason step 2"]
    worker.close(timeout_s=10)


def test_background_work_keeps_its_share_beside_closed_loops():
    """Three closed-loop sessions (each asks again as soon as answered) keep ticks queued at all times; a dynamics
    or reasoner call beside them still gets up to BACKGROUND_SHARE of the worker (before, it waited until they
    stopped), and no tick waits for more than one of its steps, as admission counts."""
    log = _Log()

    def tick_steps(job: TickJob, batch: list[TickJob]):
        time.sleep(0.02)  # ten times a step: background work may go between any two ticks, as far as the share goes
        log.add(f"tick {job.payload}")
        return job.payload
        yield

    worker = ModelWorker(tick_steps, None, max_batch=1)

    def closed_loop(name: str) -> None:
        session = object()
        for index in range(12):
            tick = TickJob(session=session, shape=name, payload=f"{name}{index}")
            log.add(f"queued {name}{index}")
            worker.submit(tick)
            tick.result.result(timeout=10)

    loops = [threading.Thread(target=closed_loop, args=(name,)) for name in "abc"]
    for loop in loops:
        loop.start()
    _until(lambda: len(log.events) >= 4)
    worker.submit(GeneratorJob(_sleeping_steps(log, 6, 0.002), lambda error: None))
    for loop in loops:
        loop.join(timeout=10)
    _until(lambda: "call step 5" in log.events)
    events = log.events
    assert events.index("call step 5") < max(events.index(f"tick {loop}11") for loop in "abc")  # before they stopped
    for name in (f"{loop}{index}" for loop in "abc" for index in range(12)):  # steps that ended while it waited
        waited = events[events.index(f"queued {name}"): events.index(f"tick {name}")]
        assert sum(event.startswith("call step") for event in waited) <= 1, name
    worker.close(timeout_s=10)


def _sleeping_steps(log: _Log, count: int, seconds: float):
    for index in range(count):
        time.sleep(seconds)
        log.add(f"call step {index}")
        yield


def test_a_failing_step_fails_its_job_and_the_worker_serves_on():
    log = _Log()
    worker = _worker(log)
    failures: list[BaseException] = []

    def broken():
        yield
        raise ValueError("bad step")

    worker.submit(GeneratorJob(broken(), failures.append))
    tick = TickJob(session=object(), shape="s", payload=7)
    worker.submit(tick)
    assert tick.result.result(timeout=10) == 7
    _until(lambda: failures)
    assert isinstance(failures[0], ValueError)
    worker.close(timeout_s=10)


def test_close_fails_queued_ticks_and_jobs_and_refuses_new_work():
    log, gate = _Log(), threading.Event()
    worker = _worker(log)
    failures: list[BaseException] = []
    worker.submit(GeneratorJob(_steps(log, "long", 2, gate), failures.append))
    while worker.queue_depth < 1 or worker._jobs:  # the long job is running
        time.sleep(0.001)
    queued_job = GeneratorJob(_steps(log, "queued", 1), failures.append)
    worker.submit(queued_job)
    tick = TickJob(session=object(), shape="s", payload=1)
    worker.submit(tick)
    closer = threading.Thread(target=worker.close, kwargs={"timeout_s": 10})
    closer.start()
    with pytest.raises(api.ShuttingDown):
        tick.result.result(timeout=10)
    gate.set()
    closer.join(timeout=10)
    assert not closer.is_alive()
    assert [type(f) for f in failures] == [api.ShuttingDown, api.ShuttingDown]  # queued, then the long one
    assert "long step 1" not in log.events  # stopped after the step in progress
    with pytest.raises(api.ShuttingDown):
        worker.submit(TickJob(session=object(), shape="s", payload=2))


def test_close_says_whether_the_worker_stopped_within_its_timeout():
    """A step that outlasts the timeout (a long device call) leaves the thread running: close says so, so that
    the process can leave without tearing the interpreter down under it."""
    log, gate, started = _Log(), threading.Event(), threading.Event()
    worker = _worker(log)
    worker.submit(GeneratorJob(_steps(log, "long", 1, gate, started), lambda error: None))
    started.wait(timeout=10)
    assert worker.close(timeout_s=0.05) is False
    gate.set()
    idle = _worker(log)
    assert idle.close(timeout_s=10) is True


def _end(gone: threading.Event) -> CallEnd:
    return CallEnd(threading.Event(), None, gone.is_set, late="")


def test_end_queued_fails_a_queued_tick_whose_caller_went_away_and_nothing_else():
    log, gate, gone = _Log(), threading.Event(), threading.Event()
    worker = _worker(log)
    worker.submit(GeneratorJob(_steps(log, "hold", 1, gate), lambda error: None))
    while worker._jobs:
        time.sleep(0.001)
    tick = TickJob(session=object(), shape="s", payload=3)
    worker.submit(tick)
    worker.end_queued(tick, _end(gone))  # no reason yet: it stays queued
    gone.set()
    worker.end_queued(tick, _end(gone))
    with pytest.raises(api.Cancelled):
        tick.result.result(timeout=0)
    gate.set()
    worker.close(timeout_s=10)
    assert "tick 3" not in log.events


class _CloseFirst:
    """A worker's condition through which the first acquisition by thread `caller` waits until `close()` has run on
    another thread: the interleaving where a caller's `end_queued` meets a `close` that takes the queues."""

    def __init__(self, real: threading.Condition, caller: threading.Thread, close) -> None:
        self._real, self._caller, self._close, self._closed = real, caller, close, False

    def __enter__(self):
        if threading.current_thread() is self._caller and not self._closed:
            self._closed = True
            closer = threading.Thread(target=self._close)
            closer.start()
            closer.join()
        return self._real.__enter__()

    def __exit__(self, *exc):
        return self._real.__exit__(*exc)

    def __getattr__(self, name):
        return getattr(self._real, name)


def test_a_caller_ending_its_queued_tick_as_close_takes_the_queue_fails_it_once():
    """engine.close() gives every waiting caller a reason to end (`closing`) just before the worker's close() fails
    what is queued: a caller's end_queued that met that close() failed the tick a second time (InvalidStateError,
    INTERNAL to its client), or took it out of the list close() was failing, which then skipped the next tick."""
    log, gate = _Log(), threading.Event()
    worker = _worker(log)
    worker.submit(GeneratorJob(_steps(log, "hold", 1, gate), lambda error: None))
    while worker._jobs:
        time.sleep(0.001)
    ticks = [TickJob(session=object(), shape="s", payload=i) for i in range(2)]
    for tick in ticks:
        worker.submit(tick)
    closing = threading.Event()
    closing.set()
    errors: list[BaseException] = []

    def end_queued():
        try:
            worker.end_queued(ticks[0], CallEnd(closing, None, None, late=""))
        except BaseException as error:  # noqa: BLE001 - what the caller would have got
            errors.append(error)

    caller = threading.Thread(target=end_queued)
    worker._changed = _CloseFirst(worker._changed, caller, lambda: worker.close(timeout_s=0.05))
    caller.start()
    caller.join(timeout=10)
    gate.set()
    assert errors == []
    for tick in ticks:
        with pytest.raises(api.ShuttingDown):
            tick.result.result(timeout=0)
    assert not [event for event in log.events if event.startswith("tick")]


def test_a_job_whose_call_ended_is_not_stepped_again():
    """Alone on the worker, a job never waits in the queue where its caller could end it: the worker checks."""
    log, gate, started, gone = _Log(), threading.Event(), threading.Event(), threading.Event()
    worker = _worker(log)
    failures: list[BaseException] = []
    worker.submit(GeneratorJob(_steps(log, "call", 3, gate, started), failures.append, _end(gone)))
    started.wait(timeout=10)
    gone.set()
    gate.set()
    _until(lambda: failures)
    assert isinstance(failures[0], api.Cancelled)
    assert log.events == ["call step 0"]
    worker.close(timeout_s=10)


def test_a_micro_batch_takes_no_tick_that_came_after_one_of_another_shape():
    """A batch holds the worker for its ticks' slots together: a tick of another shape queued before one of the
    batch's shape must not wait for it (it may have waited for that session's previous tick already)."""
    started_in: list[tuple[str, int]] = []  # each tick as it starts, and the size of its batch
    gate, started = threading.Event(), threading.Event()

    def tick_steps(job: TickJob, batch: list[TickJob]):
        started_in.append((job.payload, len(batch)))
        return job.payload
        yield

    worker = ModelWorker(tick_steps, None, max_batch=4)
    worker.submit(GeneratorJob(_steps(_Log(), "hold", 1, gate, started), lambda error: None))
    started.wait()
    ticks = [TickJob(session=object(), shape=shape, payload=name)
             for shape, name in (("s", "a"), ("s", "b"), ("t", "c"), ("s", "d"))]
    for tick in ticks:
        worker.submit(tick)
    gate.set()
    assert [t.result.result(timeout=10) for t in ticks] == ["a", "b", "c", "d"]
    assert started_in == [("a", 2), ("b", 2), ("c", 1), ("d", 1)]
    worker.close(timeout_s=10)
