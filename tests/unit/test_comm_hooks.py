"""phalanx.comm_hooks in one process: fp16 scales, PowerSGD's settings and state, names."""

from __future__ import annotations

import math

import pytest
import torch

from phalanx import comm_hooks
from phalanx.bench.options import COMM_HOOKS
from phalanx.comm_hooks.lowprec import scale_for
from tests.harness import error_of


@pytest.mark.parametrize("total", [1e-30, 3e-8, 1.0, 1.5, 4096.0, 65504.0, 1e6, 3e30])
def test_fp16_scale_brings_the_sum_of_largest_values_to_2_11_to_2_12(total):
    scale = scale_for(total)
    assert math.frexp(scale)[0] == 0.5  # a power of two: scaling is exact
    assert 2**11 <= total * scale < 2**12
    assert torch.isfinite(torch.tensor([total * scale]).half()).all()


def test_fp16_scale_leaves_zeros_and_non_finite_values_alone():
    assert scale_for(0.0) == 1.0
    assert scale_for(float("inf")) == 1.0
    assert scale_for(float("nan")) == 1.0
    assert scale_for(1e-45) == 2.0**127  # fp32's subnormals: the largest normal scale


def test_powersgd_state_checks_its_settings_and_round_trips():
    assert error_of(comm_hooks.PowerSGDState, None, 0) == (
        "ValueError", "matrix_approximation_rank must be an integer >= 1, got 0")
    assert error_of(comm_hooks.PowerSGDState, None, 2, start_powerSGD_iter=-1) == (
        "ValueError", "start_powerSGD_iter must be an integer >= 0, got -1")
    state = comm_hooks.PowerSGDState(None, 2)
    state.iter, state.errors[3], state.qs[3] = 7, torch.ones(4), torch.arange(6.0)
    saved = state.state_dict()
    other = comm_hooks.PowerSGDState(None, 2)
    other.load_state_dict(saved)
    assert other.iter == 7 and torch.equal(other.errors[3], torch.ones(4)) and torch.equal(other.qs[3], torch.arange(6.0))
    saved["errors"][3].zero_()
    assert torch.equal(other.errors[3], torch.ones(4))  # loaded copies, not the saved tensors


def test_by_name_knows_the_command_lines_names():
    assert comm_hooks.HOOK_NAMES == COMM_HOOKS  # phalanx bench's --comm-hook choices
    assert comm_hooks.by_name("none") is None
    assert comm_hooks.by_name("bf16", "group") == ("group", comm_hooks.bf16_compress_hook)
    state, hook = comm_hooks.by_name("powersgd", matrix_approximation_rank=2)
    assert hook is comm_hooks.powerSGD_hook
    assert (state.matrix_approximation_rank, state.start_powerSGD_iter) == (2, 10)
    assert error_of(comm_hooks.by_name, "int8") == (
        "ValueError", "comm hook must be one of none, fp16, bf16, powersgd, got 'int8'")
