"""The online scheduler (learner/plan/scheduler.py) driven by a synthetic clock, as the simulator drives it."""

import random

import pytest

from learner.plan.scheduler import MovingAverage, MovingMedian, Scheduler, SchedulerConfig


def make(**kw) -> Scheduler:
    return Scheduler(SchedulerConfig(rollouts_per_step=32, publish_every=1, staleness=2, **kw))


def feed(s: Scheduler, worker: str, now: float, lease_s: float, rollouts: int = 8, n: int = 3, noise=None) -> None:
    for _ in range(n):
        seconds = lease_s * (1 + noise.uniform(-0.1, 0.1)) if noise else lease_s
        s.lease_done(worker, now, seconds, rollouts)


def steps(s: Scheduler, first: int, n: int, train_s: float = 10.0, noise=None) -> list:
    decisions = []
    for step in range(first, first + n):
        t = train_s * (1 + noise.uniform(-0.1, 0.1)) if noise else train_s
        s.step_done(step, t, t, trained=True)
        s.broadcast_done(2.0)
        decisions += s.replan()
    return decisions


def test_moving_estimates():
    ema = MovingAverage(alpha=0.5, warmup=2)
    for x in (2.0, 4.0):
        ema.add(x)
    assert ema.value == 3.0 and ema.warm  # the plain mean during warm-up
    ema.add(7.0)
    assert ema.value == 5.0  # then exponential
    median = MovingMedian(window=5, warmup=3)
    for x in (1.0, 1.0, 100.0):
        median.add(x)
    assert median.value == 1.0 and median.warm  # one outlier does not move it


def test_new_workers_are_on_probation_until_measured():
    s = make()
    s.seen("a", 0.0, price=1.0)
    assert s.may_lease("a") and not s.may_lease("unknown")
    assert s.replan() == []  # nothing measured yet: no decision
    assert s.lease_deadline("a") == 120.0  # the configured timeout until its lease time is known


def test_expensive_worker_not_needed_is_deactivated_once_without_flapping():
    rng = random.Random(0)
    s = make()
    for name, price in (("cheap", 0.05), ("pricey", 2.0)):
        s.seen(name, 0.0, price)
        feed(s, name, 0.0, lease_s=1.0, noise=rng)  # 8 rollouts/s each
    # T = 10 s, B = 2 s: f = 8 * (10 - 2) / 10 = 6.4/s each; demand 1.1 * 32 / 10 = 3.52; keep 1.2 * 3.2 = 3.84
    decisions = steps(s, 1, 60, noise=rng)
    assert [(d.worker, d.active) for d in decisions] == [("pricey", False)]
    assert "not needed" in decisions[0].reason and decisions[0].step == 3  # at the first re-plan (T measured)
    assert s.may_lease("cheap") and not s.may_lease("pricey")


def test_a_worker_that_declares_a_huge_rate_and_returns_nothing_loses_its_place():
    """A hostile worker declares 1e9 rollouts/s at no price: the cheapest cover is that worker alone, so the
    honest one is switched off. Its leases expire; each is measured as nothing delivered in that time,
    and it loses its place to the honest worker again."""
    s = make()
    s.seen("liar", 0.0, price=0.0)
    s.declare("liar", 1e9, 0.001)
    s.seen("honest", 0.0, price=0.5)
    feed(s, "honest", 0.0, lease_s=1.0)  # 8 rollouts/s
    first = steps(s, 1, 10)
    assert ("honest", False) in [(d.worker, d.active) for d in first] and s.may_lease("liar")
    for _ in range(3):  # its leases run to their deadline, delivering nothing
        s.lease_expired("liar", 120.0)
    s.seen("liar", 400.0)  # and it is still there, asking for more
    steps(s, 11, 20)
    assert s.may_lease("honest") and not s.may_lease("liar")
    # a worker whose lease expired because it vanished is not marked down unless it shows up again
    s.seen("gone", 0.0, price=0.1)
    feed(s, "gone", 0.0, lease_s=1.0)
    s.lease_expired("gone", 120.0)
    assert s.workers["gone"].rollouts_per_s.value == 8.0


def test_deactivated_worker_comes_back_when_supply_falls_short():
    s = make()
    for name, price in (("cheap", 0.05), ("pricey", 2.0)):
        s.seen(name, 0.0, price)
        feed(s, name, 0.0, lease_s=1.0)
    steps(s, 1, 10)
    assert not s.may_lease("pricey")
    feed(s, "cheap", 0.0, lease_s=8.0, n=20)  # the cheap worker slows down: 1 rollout/s
    decisions = steps(s, 11, 3)
    # pricey alone now covers the demand, so the slowed cheap worker (0.8 fresh rollouts/s) is not needed
    assert [(d.worker, d.active) for d in decisions] == [("pricey", True), ("cheap", False)]
    assert "needed" in decisions[0].reason and "not needed" in decisions[1].reason


def test_free_workers_always_run_and_too_slow_ones_only_go_when_others_cover():
    s = make()
    s.seen("free", 0.0, 0.0)
    s.seen("slow", 0.0, 0.5)
    feed(s, "free", 0.0, lease_s=1.0)
    feed(s, "slow", 0.0, lease_s=30.0)  # S*T - B = 18 s < 30 s: the model finds it too slow
    decisions = steps(s, 1, 6)
    assert [(d.worker, d.active) for d in decisions] == [("slow", False)]
    assert "too stale" in decisions[0].reason
    # alone, a worker the model finds too slow keeps running: the learner waits for it, versions slow down
    s = make()
    s.seen("slow", 0.0, 0.5)
    feed(s, "slow", 0.0, lease_s=30.0)
    assert steps(s, 1, 10) == [] and s.may_lease("slow")


def test_worker_whose_rollouts_arrive_stale_is_deactivated():
    s = make()
    for name in ("a", "b"):
        s.seen(name, 0.0, 0.1)
        feed(s, name, 0.0, lease_s=1.0)
    for _ in range(8):
        s.group_arrived("b", fresh=False)
        s.group_arrived("a", fresh=True)
    decisions = steps(s, 1, 3)  # the first re-plan: T_train is measured after 3 steps
    assert [(d.worker, d.active) for d in decisions] == [("b", False)]
    assert "arrived too stale" in decisions[0].reason


def test_silent_workers_are_dropped():
    s = make(silence_s=30.0)
    s.seen("a", 0.0)
    s.seen("b", 0.0)
    s.seen("a", 25.0)
    assert s.drop_silent(31.0) == ["b"]
    assert not s.may_lease("b") and s.may_lease("a")


def test_deadlines_and_lease_sizes_follow_each_worker():
    s = make(max_groups_per_lease=4)
    for name, lease_s in (("fast", 2.0), ("mid", 2.5), ("straggler", 8.0)):
        s.seen(name, 0.0)
        feed(s, name, 0.0, lease_s=lease_s, rollouts=32)
    assert s.lease_deadline("fast") == 10.0  # 3 x 2 s, raised to the 10 s minimum
    assert s.lease_deadline("straggler") == pytest.approx(24.0)
    assert s.lease_groups("fast") == 4 and s.lease_groups("straggler") == 1


def test_lease_admission_follows_the_window_rule():
    """A lease that fills the next batch is measured by v - x <= S alone; one for a later batch must also
    come back in time, a + L <= S T (a: the version's age)."""
    from learner.plan.admission import LeaseAdmission

    s = make()  # S = 2
    s.seen("w", 0.0)
    admission = LeaseAdmission(s, "async", staleness=2, prefetch_batches=2, autoscale=False)

    def admit(held: int, age_s: float, buffered: int = 0, leased: int = 0):
        return admission.admit("w", held, 1, 100.0, version=5, age_s=age_s, batch_groups=4, buffered=buffered,
                               leased=leased)  # fmt: skip

    assert admit(held=2, age_s=1.0).refused == "stale"  # 5 - 2 > S
    assert admit(held=4, age_s=1.0).groups == 1  # with 5 being encoded: generate with 4 meanwhile
    assert admit(held=3, age_s=25.0, buffered=4).groups == 1  # L and T not measured: no evidence to refuse on
    feed(s, "w", 100.0, lease_s=8.0)
    steps(s, 1, 3)  # T = 10 s
    assert admit(held=3, age_s=12.0, buffered=4).groups == 1  # 12 + 8 <= 2 * 10
    assert admit(held=3, age_s=13.0, buffered=4).refused == "late"  # 13 + 8 > 20, for a later batch
    assert admit(held=3, age_s=13.0, buffered=2, leased=1).groups == 1  # it fills the next batch: v - x decides
    pull = LeaseAdmission(s, "pull", staleness=0, prefetch_batches=1, autoscale=False)
    assert pull.admit("w", 4, 1, 0.0, version=5, age_s=0, batch_groups=4, buffered=0, leased=0).refused == "behind"


def test_a_worker_waits_for_the_newer_version_only_when_the_learner_loses_nothing():
    """Holding x while x + 1 reaches the swarm: the lease goes out with x if the learner is short of time,
    and is declined ("newer") if the worker can fetch x + 1 and still return its share of the batch before
    the step under way ends: (1 + margin)(max(0, B - a) + k L) <= T_quick - s."""
    from learner.plan.admission import LeaseAdmission

    s = make()  # S = 2, margin 0.1
    for w in ("a", "b"):
        s.seen(w, 0.0)
    admission = LeaseAdmission(s, "async", staleness=2, prefetch_batches=1, autoscale=False)

    def admit(newer_age_s, step_age_s, buffered=0):
        return admission.admit("a", 4, 1, 100.0, version=5, age_s=1.0, batch_groups=4, buffered=buffered,
                               leased=0, newer_age_s=newer_age_s, step_age_s=step_age_s)  # fmt: skip

    assert admit(0.0, 0.0).groups == 1  # nothing measured: no evidence to make it wait
    feed(s, "a", 100.0, lease_s=2.0)
    steps(s, 1, 3)  # T = 10 s, B = 2 s
    # 2 workers, 4 groups to lease: k = 2 leases each; 1.1 * (2 + 2 * 2) = 6.6 <= 10 - s
    assert admit(0.0, 0.0).refused == "newer"
    assert admit(0.0, 3.0).refused == "newer"
    assert admit(0.0, 4.0).groups == 1  # 6.6 > 6: the learner would wait for it
    assert admit(1.5, 4.0).refused == "newer"  # x + 1 is almost there: 1.1 * (0.5 + 4) <= 6
    assert admit(0.0, 5.5, buffered=2).refused == "newer"  # k = 1: 1.1 * (2 + 2) <= 4.5
    assert admit(0.0, None).groups == 1  # the learner waits for a batch now: every lease counts
    assert admit(None, 0.0).groups == 1  # it holds the newest version
    s.step_done(4, 5.0, 5.0, trained=True)  # one quick step: T_quick = 5
    assert admit(0.0, 0.0).groups == 1  # 6.6 > 5
