"""The serving scheduler's decisions on an explicit clock: order, concurrency, shedding, rejection.

Estimates are set by hand, so every admission is exact arithmetic: no
threads, no sleeps, no timing. Most cases plan to the deadline itself
(headroom 1); one checks the default headroom.
"""
import pytest

from cuvil.serve.scheduler import Refused, Scheduler


def scheduler(slots=1, headroom=1.0, reserve=0, **models):
    """models: name=(priority, deadline_ms, estimate_ms[, max_concurrency[, threads]])."""
    s = Scheduler(slots, headroom=headroom, reserve=reserve)
    for name, (priority, deadline_ms, estimate_ms, *rest) in models.items():
        concurrency, threads = (rest + [1, 1])[:2] if rest else (1, 1)
        s.add_model(name, priority, deadline_ms, concurrency, threads, estimate_ms / 1000)
    return s


def offer(s, model, now=0.0, tag=None):
    job = s.new_job(model, now, payload=tag)
    return job, s.offer(job, now)


def started(s, now=0.0):
    return [j.payload for j in s.dispatch(now)]


def test_earliest_deadline_first_across_models():
    s = scheduler(a=("low", 100, 1), b=("low", 50, 1), c=("low", 80, 1))
    for name in "abc":
        offer(s, name, tag=name)
    order = []
    for _ in range(3):
        (job,) = s.dispatch(0.0)
        order.append(job.payload)
        s.finish(job)
    assert order == ["b", "c", "a"]


def test_priority_breaks_a_deadline_tie_then_arrival_order():
    s = scheduler(lo=("low", 100, 1), hi=("high", 100, 1), crit=("critical", 100, 1))
    offer(s, "lo", tag="lo")
    offer(s, "hi", tag="hi1")
    offer(s, "crit", tag="crit")
    order = []
    while s.queued():
        (job,) = s.dispatch(0.0)
        order.append(job.payload)
        s.finish(job)
    assert order == ["crit", "hi1", "lo"]


def test_slots_and_max_concurrency_bound_what_starts():
    s = scheduler(slots=3, m=("normal", 100, 1, 2), n=("normal", 200, 1, 1))
    for i in range(3):
        offer(s, "m", tag=f"m{i}")
    offer(s, "n", tag="n0")
    assert started(s) == ["m0", "m1", "n0"]  # m is capped at 2 at once; n fills the third slot
    assert started(s) == []
    s.finish(s.running[0])
    assert started(s) == ["m2"]


def test_a_multithreaded_library_takes_its_threads_and_is_not_starved():
    s = scheduler(slots=2, big=("normal", 50, 1, 1, 2), small=("normal", 100, 1, 4))
    offer(s, "small", tag="s0")
    assert started(s) == ["s0"]
    offer(s, "big", tag="big")  # earlier deadline than the next small job, needs both slots
    offer(s, "small", tag="s1")
    assert started(s) == []  # one slot is free, but the EDF head needs two: it waits, s1 does not jump it
    s.finish(s.running[0])
    assert started(s) == ["big"]
    s.finish(s.running[0])
    assert started(s) == ["s1"]


def test_a_request_that_cannot_meet_its_deadline_is_rejected_with_429():
    s = scheduler(m=("normal", 10, 4))  # two 4 ms jobs fit in 10 ms; the third would end at 12 ms
    offer(s, "m")
    offer(s, "m")
    with pytest.raises(Refused) as refused:
        offer(s, "m")
    assert refused.value.status == 429 and "10 ms deadline" in str(refused.value)
    assert refused.value.retry_after >= 1
    assert len(s.queued()) == 2


def test_a_critical_request_sheds_queued_lower_priority_work_least_important_first():
    s = scheduler(crit=("critical", 10, 4), low=("low", 9, 4), normal=("normal", 9, 4))
    low, _ = offer(s, "low", tag="low")
    normal, _ = offer(s, "normal", tag="normal")
    # both are ahead of the critical job (earlier deadline): it would end at 12 ms > 10 ms
    crit, shed = offer(s, "crit", tag="crit")
    assert shed == [low]  # one job shed is enough; the least important one goes
    assert {j.payload for j in s.queued()} == {"normal", "crit"}


def test_nothing_is_shed_when_shedding_would_not_save_the_newcomer():
    s = scheduler(crit=("critical", 6, 4), crit2=("critical", 5, 4), low=("low", 3, 1))
    offer(s, "low")
    offer(s, "crit2")  # ends at 5 ms: on time
    with pytest.raises(Refused) as refused:
        offer(s, "crit")  # would end at 9 ms; without the low job at 8: still late, so the low job stays
    assert refused.value.status == 429
    assert len(s.queued()) == 2


def test_equal_priority_work_is_never_shed():
    s = scheduler(a=("normal", 8, 4), b=("normal", 10, 4))
    offer(s, "a")
    offer(s, "a")
    with pytest.raises(Refused):
        offer(s, "b")
    assert len(s.queued()) == 2


def test_low_priority_ahead_is_admitted_only_while_critical_work_stays_on_time():
    s = scheduler(crit=("critical", 10, 6), low=("low", 8, 3))
    offer(s, "crit")              # crit ends at 6 ms
    offer(s, "low", tag="l1")     # goes first (deadline 8): low ends at 3, crit at 9: both on time
    with pytest.raises(Refused) as refused:
        offer(s, "low", tag="l2")  # would end at 6 (on time) but push crit to 12 > 10
    assert refused.value.status == 429 and "priority low" in str(refused.value)
    assert sorted(j.payload or "crit" for j in s.queued()) == ["crit", "l1"]


def test_running_work_counts_against_admission_and_estimates_follow_measurements():
    s = scheduler(m=("normal", 10, 4))
    offer(s, "m")
    (job,) = s.dispatch(0.0)
    offer(s, "m", now=0.0)  # 4 running + 4 queued + 4 new = 12 > 10
    with pytest.raises(Refused):
        offer(s, "m", now=0.0)
    s.finish(job, compute_s=0.002)  # measured faster than estimated: the mean moves toward it
    mean, deviation = 0.004 + 0.2 * (0.002 - 0.004), 0.2 * 0.002
    assert s.models["m"].estimate_s == pytest.approx(mean + 2 * deviation)


def test_headroom_plans_each_job_to_finish_early_and_only_critical_ones_may_use_the_rest():
    s = scheduler(headroom=0.5, crit=("critical", 10, 4), normal=("normal", 30, 4), low=("low", 100, 2))
    first, _ = offer(s, "crit")
    assert first.target == pytest.approx(0.005)  # half of its 10 ms budget
    offer(s, "crit")  # ends at 8 ms: past its plan, but a critical job is refused only past its deadline
    with pytest.raises(Refused):
        offer(s, "crit")  # 12 ms > 10
    offer(s, "normal")  # ends at 12 ms, within its 15 ms plan
    with pytest.raises(Refused):
        offer(s, "normal")  # 16 ms: before its 30 ms deadline but past its plan
    offer(s, "low")  # 14 ms of a 50 ms plan
    assert sorted(j.model for j in s.queued()) == ["crit", "crit", "low", "normal"]


def test_a_full_queue_answers_503_and_a_discarded_job_leaves_it():
    s = Scheduler(1, max_queue=2, headroom=1.0)
    s.add_model("m", "normal", 10_000, 1, 1, 0.001)
    first, _ = offer(s, "m")
    offer(s, "m")
    with pytest.raises(Refused) as refused:
        offer(s, "m")
    assert refused.value.status == 503 and "queue is full" in str(refused.value)
    assert s.discard(first) and not s.discard(first)
    offer(s, "m")


def test_a_reserved_slot_runs_only_critical_jobs():
    s = scheduler(slots=2, reserve=1, crit=("critical", 50, 1, 2), low=("low", 1000, 5, 2), mid=("normal", 20, 5))
    offer(s, "low", tag="low1")
    offer(s, "low", tag="low2")
    offer(s, "mid", tag="mid")
    assert started(s) == ["mid"]  # the earliest deadline; the second slot is the reserve
    assert started(s) == []
    offer(s, "crit", tag="crit")  # queued behind nothing that can hold it: starts at once
    assert started(s) == ["crit"]
    # a critical job whose deadline is later than a queued lower one still takes the reserve
    (mid,) = [j for j in s.running if j.payload == "mid"]
    s.finish(mid)
    assert started(s) == ["low1"]
    (crit,) = [j for j in s.running if j.payload == "crit"]
    s.finish(crit)
    offer(s, "crit", 0.0, tag="crit2")
    assert started(s) == ["crit2"]  # low2 (deadline 1 s) and crit2 (50 ms): the reserve is critical's


def test_lower_classes_are_admitted_against_the_unreserved_slots_only():
    # two slots, one reserved: 4 low jobs of 10 ms take 40 ms on the one slot they may use, so a
    # fifth with a 45 ms deadline would finish at 50 ms: rejected (on two slots it would fit)
    s = scheduler(slots=2, reserve=1, low=("low", 45, 10, 8))
    for i in range(4):
        offer(s, "low", tag=i)
    with pytest.raises(Refused) as refused:
        offer(s, "low", tag=4)
    assert refused.value.status == 429
    unreserved = scheduler(slots=2, reserve=0, low=("low", 45, 10, 8))
    for i in range(5):  # 5 x 10 ms over two slots: done at 25 ms
        offer(unreserved, "low", tag=i)
    assert len(unreserved.queued()) == 5


def test_a_lower_class_library_wider_than_the_unreserved_slots_runs_when_all_are_free():
    s = scheduler(slots=2, reserve=1, wide=("low", 1000, 5, 1, 2), crit=("critical", 50, 1))
    offer(s, "wide", tag="wide")
    assert started(s) == ["wide"]  # not starved: it takes both slots while nothing else runs
    offer(s, "crit", tag="crit")
    assert started(s) == []  # no slot free until it is done
    s.finish(s.running[0])
    assert started(s) == ["crit"]


def test_the_reserve_must_leave_a_slot():
    with pytest.raises(ValueError):
        Scheduler(2, reserve=2)


def test_refusals_let_an_inflated_estimate_decay_back_to_the_warm_up_measure():
    # one run stalled for 500 ms (a busy machine) raises the 1 ms model's estimate past its 50 ms
    # deadline; refused requests bring no new runs, so each refusal takes a tenth of the excess back
    s = scheduler(crit=("critical", 50, 1))
    job, _ = offer(s, "crit")
    s.dispatch(0.0)
    s.finish(job, 0.5)
    assert s.models["crit"].estimate_s > 0.05
    refusals = 0
    while True:
        try:
            offer(s, "crit", now=1.0 + refusals)
            break
        except Refused:
            refusals += 1
    assert 0 < refusals < 40 and s.models["crit"].estimate_s <= 0.05
