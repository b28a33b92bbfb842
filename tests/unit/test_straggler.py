"""The straggler window and its verdicts (no processes: times are given)."""

from phalanx.diagnostics.straggler import StepClock, assess


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
