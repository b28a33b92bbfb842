"""phalanx.accumulation_steps: a constant global batch at any world size."""

import logging

import pytest

import phalanx


def test_steps_keep_the_global_batch():
    assert [phalanx.accumulation_steps(64, 8, w) for w in (1, 2, 4, 8)] == [8, 4, 2, 1]
    assert phalanx.accumulation_steps(8, 4, world_size=1) == 2
    assert phalanx.accumulation_steps(8, 4) == 2  # no process group: world size 1


def test_a_global_batch_that_does_not_divide():
    with pytest.raises(ValueError, match=r"global_batch 64 is not a multiple of micro_batch 8 x "
                                         r"world size 3 = 24. It divides at world sizes 1, 2, 4, "
                                         r"8; accumulation_steps\(..., exact=False\) trains on "
                                         r"the nearest, 72 samples per step \(3 x 24\)"):
        phalanx.accumulation_steps(64, 8, 3)
    with pytest.raises(ValueError, match="none .micro_batch does not divide it."):
        phalanx.accumulation_steps(10, 4, 2)


def test_exact_false_takes_the_nearest_and_says_so(caplog):
    with caplog.at_level(logging.WARNING, logger="phalanx"):
        assert phalanx.accumulation_steps(64, 8, 3, exact=False) == 3
        assert phalanx.accumulation_steps(4, 8, 2, exact=False) == 1  # never below one
    assert "global batch 64 at world size 3: 3 micro-batches of 8 per rank train on 72" in caplog.text


@pytest.mark.parametrize("args, kind, message", [
    ((0, 8), ValueError, "Invalid global_batch 0, expected a positive integer"),
    ((64, 8, 0), ValueError, "Invalid world_size 0"),
    ((64.0, 8), TypeError, "global_batch must be an int, got float"),
    ((64, True), TypeError, "micro_batch must be an int, got bool"),
])
def test_bad_arguments(args, kind, message):
    with pytest.raises(kind, match=message):
        phalanx.accumulation_steps(*args)
