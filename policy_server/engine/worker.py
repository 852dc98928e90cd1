"""The model worker: one thread, one loop, over the control ticks and the background work of one model.

This thread is the only one that runs the model. Control ticks go first. The oldest queued tick
starts together with up to ``max_batch - 1`` queued ticks of the same shape from other sessions (a
micro-batch, see ``engine/batching.py``); each tick is a generator, and the worker runs them to the end.
Background work (warmup, reasoner and dynamics calls) is a ``BackgroundJob``: the loop runs one ``step()`` of the
oldest job, then looks at the ticks again, so a tick waits for at most one background step. Jobs
take turns, step by step. Ticks that keep the worker busy (closed-loop sessions ask again as soon as answered)
would leave background work no time at all, so while both wait, a step goes before the ticks once ticks have had
the rest of the worker since the last one, unless a tick waiting has already waited for one: background work keeps
up to ``BACKGROUND_SHARE`` of the worker, and a tick still waits for one step at most, as admission counts.

A call whose ``CallEnd`` has a reason to end (its deadline, its caller gone) ends between two steps: the worker
checks before each step of a job, and a caller waiting on a busy worker, which runs ticks first, takes its
queued tick or job off with ``end_queued``.

``close()`` stops the loop after the step in progress; queued ticks and jobs are failed with
``ShuttingDown`` so that no caller is left waiting.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from policy_server.engine import api
from policy_server.engine.batching import GenStack, run_together
from policy_server.engine.call_end import POLL_S, CallEnd
from policy_server.pipeline.policy import TickSteps

BACKGROUND_SHARE = 0.1  # of the worker's time, that background work gets while ticks wait as well


class BackgroundJob(Protocol):
    end: CallEnd | None  # what ends it early; None: only shutdown

    def step(self) -> bool:
        """Do one bounded piece of work; True when the job is finished."""

    def fail(self, error: BaseException) -> None:
        """The job will not run again (shutdown, its ``step`` raised ``error``, or its ``end`` has a reason)."""


@dataclass(eq=False)
class TickJob:
    """A queued control tick and the future its caller waits on. ``shape``: which queued ticks may start
    together; inside a batch, GEN-stack calls then group on their exact ``GenLayout.key``. ``payload``: what
    the tick runs, None while it is only reserved (its observation still being decoded)."""

    session: Any
    shape: Hashable
    payload: Any
    result: Future = field(default_factory=Future)
    arrival: int = 0  # how many ticks were submitted before it (set by `submit`)

    def fail(self, error: BaseException) -> None:
        self.result.set_exception(error)


class ModelWorker:
    """Runs ticks and the ``step()`` of background jobs on one thread.

    ``start_tick(job, batch)``: the generator of a queued tick (`Tick.steps`) in the micro-batch ``batch`` (its
    jobs, in arrival order); the worker runs the ticks of a batch together (``batching.run_together``) with
    ``gen_stack`` running their full GEN-stack calls.
    """

    def __init__(self, start_tick: Callable[[TickJob, list[TickJob]], TickSteps], gen_stack: GenStack,
                 max_batch: int) -> None:
        self._start_tick = start_tick
        self._gen_stack = gen_stack
        self._max_batch = max_batch
        self._ticks: list[TickJob] = []  # oldest first
        self._jobs: deque[BackgroundJob] = deque()
        self._running = 0  # ticks and jobs taken off the queues, not yet finished
        self._arrivals = 0  # ticks submitted so far
        self._arrivals_by_step_end = 0  # ticks submitted before the last background step ended
        self._tick_s = 0.0  # worker time ticks have taken since that step
        self._step_s = 0.0  # the time it took
        self._closed = False
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="model-worker", daemon=True)
        self._thread.start()

    @property
    def queue_depth(self) -> int:
        """Ticks and background jobs waiting or running."""
        with self._changed:
            return len(self._ticks) + len(self._jobs) + self._running

    def submit(self, job: TickJob | BackgroundJob) -> None:
        """Queue a tick or a background job; ShuttingDown once `close()` has begun."""
        with self._changed:
            if self._closed:
                raise api.ShuttingDown()
            if isinstance(job, TickJob):
                job.arrival, self._arrivals = self._arrivals, self._arrivals + 1
                self._ticks.append(job)
            else:
                self._jobs.append(job)
            self._changed.notify()

    def wait(self, job: TickJob | BackgroundJob, end: CallEnd) -> Any:
        """The result of a submitted tick, or of a background job with a ``result`` future. Ticks go first, so
        ``job`` may wait long in the queue: it ends there once ``end`` has a reason (``end_queued``)."""
        while True:
            try:
                return job.result.result(timeout=POLL_S)
            except FutureTimeout:
                self.end_queued(job, end)

    def end_queued(self, job: TickJob | BackgroundJob, end: CallEnd) -> None:
        """Fail a tick that has not started, or a background job between two of its steps, if ``end`` has a
        reason now; nothing while the tick or a step of the job runs (the tick checks ``end`` itself, the worker
        checks a job's before each step)."""
        if (reason := end.reason()) is None:
            return
        with self._changed:  # the queues as they are now: `close` may have taken them (and failed the job) already
            queued = self._ticks if isinstance(job, TickJob) else self._jobs
            if job not in queued:
                return
            queued.remove(job)
        job.fail(reason)

    def close(self, timeout_s: float) -> bool:
        """Stop after the step in progress (waiting ``timeout_s`` at most) and fail everything queued; returns
        whether the worker thread stopped."""
        with self._changed:
            self._closed = True
            ticks, self._ticks = self._ticks, []
            jobs, self._jobs = list(self._jobs), deque()
            self._changed.notify_all()
        for tick in ticks:
            tick.fail(api.ShuttingDown())
        for job in jobs:
            job.fail(api.ShuttingDown())
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    # ------------------------------------------------------------------------------ the loop

    def _loop(self) -> None:
        torch.set_grad_enabled(False)  # the worker only infers (grad mode is per thread)
        while True:
            with self._changed:
                while not (self._closed or self._ticks or self._jobs):
                    self._changed.wait()
                if self._closed:
                    return
                if self._ticks and not (self._jobs and self._background_due()):
                    batch, job = self._take_batch(), None
                    self._running += len(batch)
                else:
                    batch, job = [], self._jobs.popleft()
                    self._running += 1
            start = time.perf_counter()
            try:
                if batch:
                    self._run_batch(batch)
                else:
                    self._step(job)
            finally:
                took_s = time.perf_counter() - start
                with self._changed:
                    self._running -= len(batch) if batch else 1
                    if batch:
                        self._tick_s += took_s
                    else:
                        self._tick_s, self._step_s = 0.0, took_s
                        self._arrivals_by_step_end = self._arrivals

    def _background_due(self) -> bool:
        """Whether a background step goes before the ticks waiting (under the lock): ticks have run for
        (1 - share) / share times the last step's time since it, and every tick waiting came after it."""
        return (self._tick_s * BACKGROUND_SHARE >= self._step_s * (1 - BACKGROUND_SHARE)
                and self._ticks[0].arrival >= self._arrivals_by_step_end)

    def _take_batch(self) -> list[TickJob]:
        """The oldest tick and the ticks of its shape from other sessions queued after it, up to the first of
        another shape (under the lock): a batch holds the worker for its ticks' slots together, so a tick left
        waiting must not wait for one that came after it, of a session whose earlier tick it may have waited for
        already (admission counts one tick of each other session ahead of it)."""
        batch = [self._ticks.pop(0)]
        while self._ticks and len(batch) < self._max_batch:
            tick = self._ticks[0]
            if tick.shape != batch[0].shape or any(tick.session is b.session for b in batch):
                break
            batch.append(self._ticks.pop(0))
        return batch

    def _run_batch(self, batch: list[TickJob]) -> None:
        ticks = []
        for job in batch:
            try:
                ticks.append((self._start_tick(job, batch), job.result))
            except BaseException as error:  # the caller gets it, the worker keeps serving
                job.fail(error)
        run_together(ticks, self._gen_stack)

    def _step(self, job: BackgroundJob) -> None:
        # Alone on the worker, a job is stepped back to back and never waits in the queue where its caller
        # could end it.
        if job.end is not None and (reason := job.end.reason()) is not None:
            job.fail(reason)
            return
        try:
            finished = job.step()
        except BaseException as error:  # the job's caller gets it; the worker keeps serving
            job.fail(error)
            return
        if not finished:
            with self._changed:
                if self._closed:
                    job.fail(api.ShuttingDown())
                else:
                    self._jobs.append(job)


class GeneratorJob:
    """A background job whose steps are the yields of a generator; ``on_fail(error)`` when it cannot finish."""

    def __init__(self, steps: Iterator[Any], on_fail: Callable[[BaseException], None],
                 end: CallEnd | None = None) -> None:
        self._steps, self._on_fail, self.end = steps, on_fail, end

    def step(self) -> bool:
        try:
            next(self._steps)
        except StopIteration:
            return True
        return False

    def fail(self, error: BaseException) -> None:
        self._steps.close()
        self._on_fail(error)
