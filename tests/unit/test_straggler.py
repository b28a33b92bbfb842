"""The straggler window and its verdicts (no processes: times are given)."""

from phalanx.diagnostics.straggler import StepClock, assess, look_back


def _steps(clock, compute, between, wait, n, start=0.0):
    t, waited = start, 0.0
    for _ in range(n):
        clock.forward(waited, t)
        waited += wait
        t += compute + wait
        clock.backward_done(waited, t)
        t += between
    return t


def test_the_clock_splits_each_step_into_compute_wait_and_between():
    clock = StepClock(every=4)
    _steps(clock, compute=0.2, between=0.05, wait=0.1, n=4)
    assert clock.due() and clock.steps == 4
    compute, wait, between = clock.take()
    assert (round(compute, 6), round(wait, 6), round(between, 6)) == (0.2, 0.1, 0.05)
    assert clock.window.compute == [] and not StepClock(every=0).due()


def test_a_rank_slower_in_its_data_is_named_and_even_ranks_are_not():
    even = assess([[0.1, 0.02, 0.01], [0.1, 0.021, 0.012], [0.11, 0.02, 0.01]], steps=30)
    assert even["slow"] == [] and even["lines"] == []
    slow = assess([[0.1, 0.5, 0.001], [0.1, 0.0, 0.5]], steps=30)
    assert slow["slow"] == [1]
    assert slow["lines"] == [
        "rank 1 is 5.9x slower than the median of the other ranks, in time between steps "
        "(data, optimizer, logging): 0.500 s per step (others 0.001 s); forward+backward "
        "0.100 s, between steps 0.500 s, waiting 0.000 s"]
    compute = assess([[0.21, 0.0, 0.01], [0.1, 0.11, 0.01], [0.1, 0.11, 0.01]], steps=10)
    assert compute["slow"] == [0] and "in forward+backward: 0.210 s" in compute["lines"][0]
    assert compute["ranks"][0] == {"compute": 0.21, "wait": 0.0, "between": 0.01}


def test_a_long_window_takes_a_first_look_after_five_steps():
    clock = StepClock(every=200)
    _steps(clock, compute=0.1, between=0.0, wait=0.0, n=5)
    assert clock.due()
    short = StepClock(every=10)
    _steps(short, compute=0.1, between=0.0, wait=0.0, n=5)
    assert not short.due()


def test_a_few_steps_name_a_gross_straggler_only():
    # over a handful of warm-up steps one of two ranks was 1.9x slower (the quick start on
    # two loaded cores): the first look and the look at the end name nobody for that...
    warm_up = [[0.013, 0.02, 0.007], [0.039, 0.0, 0.007]]
    assert assess(warm_up, steps=5)["slow"] == [1]  # (a full window's rule would)
    assert assess(warm_up, steps=5, gross=True)["slow"] == []
    # ... nor for 3x of a tiny step, under a tenth of a second more
    assert assess([[0.01, 0.03, 0.0], [0.04, 0.0, 0.0]], steps=5, gross=True)["slow"] == []
    # 3x the fastest rank and 0.1 s more: named, against the fastest, not the median
    gross = assess([[0.05, 0.2, 0.0], [0.1, 0.15, 0.0], [0.05, 0.1, 0.16]], steps=5, gross=True)
    assert gross["slow"] == [2]
    assert gross["lines"] == [
        "rank 2 is 4.2x slower than the fastest other rank, in time between steps (data, "
        "optimizer, logging): 0.160 s per step (others 0.000 s); forward+backward 0.050 s, "
        "between steps 0.160 s, waiting 0.100 s"]


def test_the_first_look_is_gross_and_steps_since_a_report_are_pending():
    clock = StepClock(every=200)
    assert not clock.pending()
    _steps(clock, compute=0.1, between=0.0, wait=0.0, n=5)
    assert clock.early() and clock.pending()
    clock.take()
    assert not clock.pending()
    _steps(clock, compute=0.1, between=0.0, wait=0.0, n=1, start=10.0)
    assert not clock.early() and clock.pending()
    off = StepClock(every=0)
    _steps(off, compute=0.1, between=0.0, wait=0.0, n=3)
    assert not off.pending()  # reports off: no look at the end either


def test_the_look_at_the_end_takes_the_first_ddp_every_rank_sent():
    slow, fast = [0.1, 0.0, 0.5], [0.1, 0.5, 0.001]
    report = look_back({0: [[0, 3, 3, fast]], 1: [[0, 3, 3, slow]]}, world_size=2)
    assert report["slow"] == [1] and report["window"] == 3 and report["steps"] == 3
    assert report["lines"][0].startswith("rank 1 is 5") and "0.500 s per step" in report["lines"][0]
    assert look_back({0: [[0, 3, 3, fast]]}, world_size=2) is None  # rank 1 never came
    # a DDP only rank 1 still has steps of is left out; the one both have is assessed
    both = look_back({0: [[1, 8, 3, fast]], 1: [[0, 5, 5, fast], [1, 8, 3, slow]]}, world_size=2)
    assert both["slow"] == [1] and both["steps"] == 8 and both["window"] == 3
    assert look_back({0: [[0, 5, 5, fast]], 1: [[1, 8, 3, slow]]}, world_size=2) is None
