"""Which request runs next, and which are turned away: earliest deadline first on one pool of cores.

Every model has its own queue; one process-wide pool has `slots` cores. A job
costs as many slots as its library runs threads, and a model runs at most
`max_concurrency` jobs at once. `dispatch` starts, while slots are free, the
queued job with the earliest deadline (the model's priority breaks ties, then
arrival order) among models below their concurrency.

Admission works on estimates (each model's compute time: measured at warm-up,
then a moving average of its runs plus twice their moving mean deviation, as
TCP estimates a retransmission timeout), with the work spread over the slots.
A job is planned to finish within `headroom` (default 0.5) of its deadline
budget, so estimates that are off, a long job that cannot be interrupted and
the time a request spends in HTTP before it is queued do not make it late:

- a newcomer that would finish after its planned time displaces queued jobs ahead
  of it that are strictly less important, least important first (then latest
  deadline first); they are *shed* (503). If that is not enough, nothing is
  displaced and the newcomer is *rejected* (429), except a critical one that
  still meets its deadline itself: that one is admitted;
- a newcomer that would push a more important queued job past its planned time
  is rejected;
- a model's queue holds at most `max_queue` jobs.

So under overload the lower classes absorb it: their requests are rejected or
shed while the critical ones still meet their deadlines. Jobs already admitted
are never dropped for lateness: a late answer is still an answer, counted as a
deadline miss.

The class is pure bookkeeping with an explicit clock (`now` in seconds), so its
decisions can be tested exactly; the server calls it under one lock.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any

from ..config import PRIORITIES

RANKS = {name: rank for rank, name in enumerate(PRIORITIES)}  # 0: critical


class Refused(Exception):
    """A job the scheduler will not run: `status` 429 (rejected on arrival) or 503 (shed from the queue)."""

    def __init__(self, message: str, status: int, retry_after: float):
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after  # seconds: when the backlog should have drained


@dataclass(eq=False)
class Job:
    model: str
    deadline: float  # absolute, on the scheduler's clock
    arrival: float
    target: float  # when admission plans it to be done: arrival + headroom x (deadline - arrival)
    payload: Any = None  # what the caller runs; the scheduler never looks at it
    rank: int = 0
    cost: int = 1
    seq: int = 0
    started: float | None = None

    @property
    def order(self):
        return (self.deadline, self.rank, self.seq)


@dataclass
class _Model:
    priority: str
    deadline_s: float
    max_concurrency: int
    cost: int
    estimate_s: float  # what admission plans with: mean + 2 x deviation
    mean_s: float = 0.0
    deviation_s: float = 0.0
    base_s: float = 0.0  # the warm-up's measure: what a refusal lets the estimate decay towards
    queue: list[Job] = field(default_factory=list)
    running: int = 0


class Scheduler:
    SMOOTHING = 0.2  # weight of the newest compute time in a model's estimate

    def __init__(self, slots: int, max_queue: int = 256, headroom: float = 0.5, reserve: int = 0):
        if slots < 1:
            raise ValueError("the scheduler needs at least one slot")
        if not 0 <= reserve < slots:
            raise ValueError("the slots reserved for critical jobs must leave at least one for the others")
        self.slots = slots
        # slots only critical jobs may take: the others run on `slots - reserve` at most, so a critical
        # job never waits for a long lower-class run, and the cores left idle by the lower classes
        # serve HTTP (parsing, answering) while they are overloaded
        self.reserve = reserve
        self.headroom = headroom
        self.max_queue = max_queue
        self.models: dict[str, _Model] = {}
        self.running: list[Job] = []
        self._seq = itertools.count()

    # --- models

    def add_model(self, name: str, priority: str = "normal", deadline_ms: int = 1000, max_concurrency: int = 1,
                  threads: int = 1, estimate_s: float = 0.001):
        # A library built for more threads than the pool has still runs: on all of it.
        self.models[name] = _Model(priority, deadline_ms / 1000, max_concurrency, min(threads, self.slots),
                                   estimate_s, estimate_s, base_s=estimate_s)

    def set_estimate(self, name: str, seconds: float):
        model = self.models[name]
        model.estimate_s = model.mean_s = model.base_s = seconds
        model.deviation_s = 0.0

    def set_threads(self, name: str, threads: int):
        self.models[name].cost = min(threads, self.slots)

    # --- jobs

    def new_job(self, model: str, now: float, payload=None) -> Job:
        m = self.models[model]
        return Job(model, now + m.deadline_s, now, now + self.headroom * m.deadline_s, payload, RANKS[m.priority],
                   m.cost, next(self._seq))

    def offer(self, job: Job, now: float) -> list[Job]:
        """Queue `job`, or raise Refused (429). Returns the queued jobs shed (503) to make room for it."""
        shed = self._plan(job, now)
        for victim in shed:
            self.models[victim.model].queue.remove(victim)
        self.models[job.model].queue.append(job)
        return shed

    def precheck(self, model: str, now: float) -> None:
        """Raise Refused if a job of `model` arriving now would be refused; change nothing. The server
        asks before it reads a request's body, so a refusal under overload costs little."""
        m = self.models[model]
        self._plan(Job(model, now + m.deadline_s, now, now + self.headroom * m.deadline_s, None,
                       RANKS[m.priority], m.cost, next(self._seq)), now)

    def _plan(self, job: Job, now: float) -> list[Job]:
        """Admission of `job` (see the module docstring): the queued jobs to shed for it, or Refused."""
        model = self.models[job.model]
        if len(model.queue) >= self.max_queue:
            raise Refused(f"model '{job.model}': its queue is full ({self.max_queue} requests)", 503,
                          self.drain_time(now))
        queued = sorted(self.queued(), key=lambda j: j.order)
        ahead = [j for j in queued if j.order < job.order]
        behind = [j for j in queued if j.order > job.order]
        slots = self._slots_for(job)
        start = now + self._running_work(now) / slots
        finish = start + (sum(self._work(j) for j in ahead) + self._work(job)) / slots
        shed = []
        if finish > job.target:
            victims = sorted((j for j in ahead if j.rank > job.rank), key=lambda j: (-j.rank, -j.deadline, -j.seq))
            for victim in victims:
                if finish <= job.target:
                    break
                shed.append(victim)
                finish -= self._work(victim) / slots
            # Shedding aims at the plan; only a critical job is still admitted when it then ends
            # between its plan and its deadline: the lower classes are the ones that absorb overload.
            if finish > (job.deadline if job.rank == 0 else job.target):
                self._decay(model)
                raise Refused(f"model '{job.model}': the server is at capacity; this request would miss its "
                              f"{(job.deadline - job.arrival) * 1000:.0f} ms deadline", 429, self.drain_time(now))
        # Would the newcomer make a more important queued job late?
        pushed = finish
        for other in behind:
            pushed += self._work(other) / slots
            if other.rank < job.rank and pushed > other.target >= pushed - self._work(job) / slots:
                raise Refused(f"model '{job.model}': the server is at capacity for requests of priority "
                              f"{PRIORITIES[job.rank]}", 429, self.drain_time(now))
        return shed

    def dispatch(self, now: float) -> list[Job]:
        """The jobs to start now, earliest deadline first, while slots and concurrency allow."""
        started = []
        while True:
            free = self.slots - sum(j.cost for j in self.running)
            # what the lower classes may still take: the slots less the reserve and their own runs
            free_lower = self.slots - self.reserve - sum(j.cost for j in self.running if j.rank > 0)
            heads = [min(m.queue, key=lambda j: j.order) for m in self.models.values()
                     if m.queue and m.running < m.max_concurrency]
            if not heads:
                return started
            job = min(heads, key=lambda j: j.order)
            if job.cost > free:  # wait for slots rather than let smaller jobs starve it
                return started
            # (a lower-class library with more threads than the unreserved slots runs when all are free)
            if job.rank > 0 and min(job.cost, self.slots - self.reserve) > free_lower:
                # the earliest is a lower-class job and the rest is reserved: a queued critical job
                # (a later deadline) may still start now
                critical = [j for j in heads if j.rank == 0 and j.cost <= free]
                if not critical:
                    return started
                job = min(critical, key=lambda j: j.order)
            model = self.models[job.model]
            model.queue.remove(job)
            model.running += 1
            job.started = now
            self.running.append(job)
            started.append(job)

    def finish(self, job: Job, compute_s: float | None = None):
        """A started job is done; `compute_s`, when measured, updates its model's estimate."""
        self.running.remove(job)
        model = self.models[job.model]
        model.running -= 1
        if compute_s is not None:
            error = compute_s - model.mean_s
            model.mean_s += self.SMOOTHING * error
            model.deviation_s += self.SMOOTHING * (abs(error) - model.deviation_s)
            model.estimate_s = model.mean_s + 2 * model.deviation_s

    def _decay(self, model: _Model):
        """A refused job brings no measurement: without this, one run stalled on a busy machine could
        raise a model's estimate past its deadline and have every later request refused. Each refusal
        takes a tenth of the estimate's excess over the warm-up's measure back."""
        model.mean_s = model.base_s + 0.9 * max(0.0, model.mean_s - model.base_s)
        model.deviation_s *= 0.9
        model.estimate_s = model.mean_s + 2 * model.deviation_s

    def discard(self, job: Job) -> bool:
        """Forget a queued job (its client went away); False if it is not queued."""
        queue = self.models[job.model].queue
        if job in queue:
            queue.remove(job)
            return True
        return False

    def queued(self) -> list[Job]:
        return [j for m in self.models.values() for j in m.queue]

    # --- estimates

    def _slots_for(self, job: Job) -> int:
        """The slots a job's class may run on: all for a critical one, the unreserved for the others."""
        return self.slots if job.rank == 0 else self.slots - self.reserve

    def _work(self, job: Job) -> float:
        """Slot-seconds of a job."""
        return self.models[job.model].estimate_s * job.cost

    def _running_work(self, now: float) -> float:
        return sum(max(0.0, self._work(j) - (now - j.started) * j.cost) for j in self.running)

    def drain_time(self, now: float) -> float:
        """Seconds until the work started and queued now should be done: a Retry-After."""
        work = self._running_work(now) + sum(self._work(j) for j in self.queued())
        return max(1.0, math.ceil(work / self.slots))
