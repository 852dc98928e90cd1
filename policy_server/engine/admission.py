"""Admission control: which sessions fit on one model worker, and how long each tick may hold it.

Ticks run one batch at a time on the worker, in arrival order, and a session has at most one tick
queued or running (``engine.act`` refuses a second one). So the worst a tick can meet is every other
session's tick queued just before it, plus one piece of background work (a reasoner step), running as it
arrives or let go before it (``engine/worker.py``), whatever the arrival pattern. Each session gets a *slot*: the
model time its ticks are planned in. The set of sessions is admitted when

    blocking + sum(slot_j) <= budget_i   for every session i        (each tick meets its budget)
    sum(rate_j * slot_j) <= max_utilization                          (each declared rate is sustained)

with every slot at least the session's cheapest tick (the planner's floor: maximal caching and every
fallback). Slots then grow from that floor toward the uncached tick by one common fraction, as far as
both conditions allow, and where every uncached tick fits, by one common share of the room left, which only the
first condition bounds (a tick still plans the uncached tick, so the rates' load stays the uncached ticks'). A tick is
planned in its slot and its deadline guard holds it there, however long its own budget. A micro-batch
takes only ticks queued before any of another shape, and may hold the worker for its ticks' slots
together (each tick within its own budget), as they would one after another: no tick waits longer.

A session that declares a rate asks no faster than that (``RateLimiter``); rate 0 declares a closed
loop (a simulation asking again as soon as it is answered), which the deadline test covers on its own.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from policy_server.engine import api
from policy_server.limits import MAX_BUDGET_MS, MAX_INSTRUCTION_TOKENS

if TYPE_CHECKING:  # sessions hold a Demand: these two import this module
    from policy_server.budget.planner import TickPlan
    from policy_server.engine.served import ServedModel
    from policy_server.engine.sessions import Opening, SessionState, SessionTable

logger = logging.getLogger(__name__)

# Of the worker's time, what declared rates may claim: the rest absorbs timing noise and the transport.
MAX_UTILIZATION = 0.9
# How often an idle server times one shape's ticks again before refusing a budget as below its cheapest tick (s),
# and for budgets within what factor of it: a busy moment slows ticks by less (session 37: 3x beside 16 busy
# processes on 2 cores); a budget further off is out of reach however quiet the machine.
RETIME_INTERVAL_S = 60.0
RETIME_MAX_FACTOR = 10.0


@dataclass(frozen=True)
class Demand:
    """What one session asks of the worker (ms, Hz).

    floor_ms: its cheapest tick; ceiling_ms: its uncached tick (no slot needs more); floor_stages_ms: the
    cheapest tick's predicted stages (what a refusal names).
    """

    budget_ms: float
    rate_hz: float
    floor_ms: float
    ceiling_ms: float
    floor_stages_ms: Mapping[str, float] = field(default_factory=dict)


def assign_slots(demands: list[Demand], blocking_ms: float,
                 max_utilization: float = MAX_UTILIZATION) -> list[float] | None:
    """One slot (ms) per demand, in order, or None when the demands cannot all be met."""
    if not demands:
        return []
    room = min(d.budget_ms for d in demands) - blocking_ms
    floor = sum(d.floor_ms for d in demands)
    load = sum(d.rate_hz * d.floor_ms for d in demands) / 1e3
    if floor > room or load > max_utilization:
        return None
    growth = [max(d.ceiling_ms - d.floor_ms, 0.0) for d in demands]
    rate_growth = sum(d.rate_hz * g for d, g in zip(demands, growth, strict=True)) / 1e3
    fraction = 1.0
    if sum(growth) > 0:
        fraction = min(fraction, (room - floor) / sum(growth))
    if rate_growth > 0:
        fraction = min(fraction, (max_utilization - load) / rate_growth)
    if fraction < 1.0:
        return [d.floor_ms + fraction * g for d, g in zip(demands, growth, strict=True)]
    # Every uncached tick fits: what is left of the room is shared as well, for the guard of a tick that runs slower
    # than planned (a loaded machine), which must still end within its slot, not its own budget: the ticks queued
    # behind it were admitted on its slot. Only the room bounds it: a tick plans the uncached tick whatever its slot
    # beyond, so the rates' load is the ceilings', which fits (fraction 1); a lone session's slot is its whole room.
    ceilings = [max(d.ceiling_ms, d.floor_ms) for d in demands]
    extra = max(room - sum(ceilings), 0.0) / len(demands)
    return [c + extra for c in ceilings]


def admitted_slots(demands: list[Demand], blocking_ms: float,
                   max_utilization: float = MAX_UTILIZATION) -> list[float]:
    """`assign_slots` of demands admitted together beside a background piece that may have grown since (a lasting
    slowdown, `CostModel.background_ms`): as much of it as leaves each its cheapest tick. So a session keeps what it
    was admitted with when the others leave, and the guard holds each tick's deadline when the queue wait grows."""
    room_ms = min((d.budget_ms for d in demands), default=0.0) - sum(d.floor_ms for d in demands)
    return assign_slots(demands, min(blocking_ms, room_ms), max_utilization)


def sessions_that_fit(open_demands: list[Demand], new: Demand, blocking_ms: float, limit: int,
                      max_utilization: float = MAX_UTILIZATION) -> int:
    """How many sessions like ``new`` fit beside ``open_demands`` (at most ``limit``)."""
    count = 0
    while count < limit and assign_slots([*open_demands, *[new] * (count + 1)], blocking_ms,
                                         max_utilization) is not None:
        count += 1
    return count


def default_rate_hz(control_hz: float, actions_per_chunk: int) -> float:
    """The chunk-request rate of a client that executes ``actions_per_chunk`` actions per chunk."""
    return control_hz / actions_per_chunk


class Admission:
    """Which sessions one engine takes: every open session's demand must still be met with a new one (or a
    new budget), else Overloaded with how many would fit. `retime(key)`: time the ticks of cost key `key` and the
    background pieces again, on the worker, and wait."""

    def __init__(self, served: ServedModel, sessions: SessionTable, retime: Callable[[tuple], None]):
        self.served, self.sessions, self.retime = served, sessions, retime
        self._lock = threading.Lock()  # held while slots are assigned, so two opens cannot both fit
        self._retimed_s: dict[tuple, float] = {}  # when each cost key was last timed again (time.monotonic() s)

    def blocking_ms(self) -> float:
        """The longest background piece a tick may find running (`CostModel.background_ms`: known after warmup, and
        moving with the live ticks' speed)."""
        return self.served.cost_model.background_ms

    def capacity(self, budget_ms: float, rate_hz: float | None) -> tuple[api.Capacity, ...]:
        """Per served embodiment at its default chunk: sessions that fit alone and beside the open ones, on the
        timings at hand: never timed again here, unlike in `open`, nor waiting for `_lock`, which an opening holds
        while it times ticks again. A client asks this first (`GetServerInfo`, at the default budget) and must not
        wait seconds on ticks it did not ask for. A report: an opening or a new budget meanwhile may change it."""
        limit = self.served.settings.max_sessions
        sessions = self.sessions.all()
        open_demands = [s.demand for s in sessions]
        out = []
        for embodiment in self.served.embodiments.values():
            chunk = embodiment.default_chunk_size
            rate = default_rate_hz(embodiment.fps, chunk) if rate_hz is None else rate_hz
            demand = self.demand(embodiment.name, chunk, budget_ms, rate)
            out.append(api.Capacity(
                embodiment=embodiment.name, chunk_size=chunk, budget_ms=budget_ms, rate_hz=rate,
                sessions_alone=sessions_that_fit([], demand, self.blocking_ms(), limit),
                sessions_more=sessions_that_fit(open_demands, demand, self.blocking_ms(), limit - len(sessions)),
            ))
        return tuple(out)

    def demand(self, embodiment: str, chunk: int, budget_ms: float, rate_hz: float, preview: bool = False) -> Demand:
        """A session's claim on the worker: its cheapest tick (the planner's floor) and its uncached tick, at
        the longest instruction it may send (an observation may change the instruction at any tick), with the
        decode of its predicted frames when it asked for them."""
        served = self.served
        key = self._demand_key(embodiment, chunk)

        def plan(time_left_ms: float) -> TickPlan:
            return served.budget.plan(key, time_left_ms, served.num_steps, served.passes, None, prefill=True,
                                      preview=preview, frontier=served.frontier(embodiment))

        ceiling = plan(MAX_BUDGET_MS)
        floor = plan(1e-3) if served.budget_controlled else ceiling
        return Demand(budget_ms, rate_hz, floor.predicted_ms, ceiling.predicted_ms, floor.predicted_stage_ms)

    def _demand_key(self, embodiment: str, chunk: int) -> tuple:
        return self.served.cost_key(embodiment, chunk, MAX_INSTRUCTION_TOKENS)

    def open(self, opening: Opening, open_session: Callable[[Demand], SessionState]) -> tuple[SessionState, bool]:
        """Admit a session of this shape, budget and rate beside the open ones (`demand`) and open it with
        `open_session(demand)`: (the session, True). An opening that repeats an open session's request id gets that
        session, admitted once: (it, False); `SessionTable.opened_by`."""
        if (session := self.sessions.opened_by(opening)) is not None:  # a retry: not refused by what changed since
            return session, False
        demand = self._feasible_demand(opening.embodiment, opening.chunk_size, opening.budget_ms, opening.rate_hz,
                                       opening.preview)
        self._check_floor(demand)
        with self._lock:
            # Its first arrival may have opened it meanwhile (this one waited for the lock, or for a retiming).
            if (session := self.sessions.opened_by(opening)) is not None:
                return session, False
            self._admit([*[s.demand for s in self.sessions.all()], demand], demand, "this session")
            session = open_session(demand)
            self._assign_slots()
        return session, True

    def _feasible_demand(self, embodiment: str, chunk: int, budget_ms: float, rate_hz: float,
                         preview: bool = False) -> Demand:
        """`demand`, its shape's ticks timed again first where their cheapest is above the budget (within
        `RETIME_MAX_FACTOR`), as an idle server does once per `RETIME_INTERVAL_S`: timings taken while something
        else held the machine (a warmup during a busy boot) must not refuse budgets until a restart. Only with no
        session open, so no tick waits behind the timing ticks."""
        demand = self.demand(embodiment, chunk, budget_ms, rate_hz, preview)
        cheapest_ms = demand.floor_ms + self.blocking_ms()
        if not budget_ms < cheapest_ms <= RETIME_MAX_FACTOR * budget_ms:
            return demand
        key = self._demand_key(embodiment, chunk)
        with self._lock:  # no session opens meanwhile
            now_s = time.monotonic()
            if self.sessions.all() or now_s - self._retimed_s.get(key, -RETIME_INTERVAL_S) < RETIME_INTERVAL_S:
                return demand
            logger.info("a budget of %g ms is below the cheapest tick of %.0f ms: timing these ticks again (the "
                        "timings may come from a busy moment)", budget_ms, cheapest_ms)
            self.retime(key)
            self._retimed_s[key] = time.monotonic()
        return self.demand(embodiment, chunk, budget_ms, rate_hz, preview)

    def change_budget(self, session: SessionState, budget_ms: float) -> None:
        old = session.demand
        demand = replace(old, budget_ms=budget_ms)
        self._check_floor(demand)
        with self._lock:
            others = [s.demand for s in self.sessions.all() if s is not session]
            self._admit([*others, demand], demand, f"a budget of {budget_ms:g} ms for this session")
            session.demand, session.budget_ms = demand, budget_ms
            self._assign_slots()

    def close(self, session_id: str, why: str) -> SessionState:
        """Close the session (``why``: what closed it, in words), share its room among the others, tell the stream
        attached to it, and return it."""
        with self._lock:
            session = self.sessions.close(session_id, why)
            self._assign_slots()
        session.tell_closed()
        return session

    def close_idle(self, idle_s: float) -> None:
        """Close the sessions idle for ``idle_s`` (`SessionState.idle`: their clients went away without closing
        them), and share their room among the others."""
        now_s = time.monotonic()
        if not any(session.idle(now_s, idle_s) for session in self.sessions.all()):
            return
        with self._lock:
            closed = self.sessions.close_idle(now_s, idle_s)
            self._assign_slots()
        for session in closed:
            logger.info("closed session %s: no call for %.0f s", session.describe(), now_s - session.last_used_s)
            session.tell_closed()  # no stream is attached to an idle session, unless one attached as it closed

    def _check_floor(self, demand: Demand) -> None:
        """BudgetInfeasible when even an idle server cannot meet the budget: the cheapest tick after the longest
        background piece it may wait for (`assign_slots` gives any session no less)."""
        wait_ms = self.blocking_ms()
        if demand.floor_ms + wait_ms > demand.budget_ms:
            stages = {**demand.floor_stages_ms, **({"background piece": wait_ms} if wait_ms else {})}
            raise api.BudgetInfeasible(demand.budget_ms, demand.floor_ms + wait_ms, stages)

    def _admit(self, demands: list[Demand], new: Demand, what: str) -> None:
        """Raise Overloaded, saying it cannot take ``what``, unless every demand (``new`` among them) can be met
        (under ``_lock``)."""
        blocking_ms = self.blocking_ms()
        if assign_slots(demands, blocking_ms) is not None:
            return
        others = [d for d in demands if d is not new]
        alone = sessions_that_fit([], new, blocking_ms, self.served.settings.max_sessions)
        queue_ms = blocking_ms + sum(d.floor_ms for d in demands)
        load = sum(d.rate_hz * d.floor_ms for d in demands) / 1e3
        unused = f"; {self.sessions.longest_unused(self.served.settings.session_idle_s)}" if others else ""
        raise api.Overloaded(
            f"the server cannot take {what}: with the {len(others)} open session(s), a tick could wait "
            f"{queue_ms:.0f} ms against the tightest budget of {min(d.budget_ms for d in demands):g} ms, and "
            f"the declared rates would claim {load:.1%} of the model, of at most {MAX_UTILIZATION:.0%}; no session "
            "like this one fits beside them, "
            f"{alone} would on an idle server (a larger budget or a lower rate_hz fits more){unused}",
            sessions_fit=alone)

    def _assign_slots(self) -> None:
        sessions = self.sessions.all()
        slots = admitted_slots([s.demand for s in sessions], self.blocking_ms())
        for session, slot in zip(sessions, slots, strict=True):
            session.slot_ms = slot
