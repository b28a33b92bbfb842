"""torch's own CPU DDP tests of comm hooks and join, on phalanx's DistributedDataParallel (issue 21).

Part 1 runs torch's test methods themselves, from the installed
``torch/testing/_internal/distributed/distributed_test.py`` (``DistributedTest._DistTestBase``),
each in its own group of 2 ranks on Gloo as torch's ``test_distributed_spawn.py`` runs them, with
phalanx's class in place of torch's (:mod:`tests.dist.torch_suite`). :data:`TORCH_TESTS` is the
selection: every test whose name holds ``comm_hook``, ``join`` or ``uneven`` (torch runs them
all on GPUs only: they are skipped here with torch's own reason), the DDP tests that run on
Gloo without GPUs and register a comm hook, and those of torch's CPU tests that read
``_get_ddp_logging_data()`` which pass on phalanx (:data:`TORCH_CPU_LOGGING`).

Part 2 is our own code for what torch's wheel does not ship: ``test/distributed/test_c10d_gloo.py``'s
``DistributedDataParallelTest`` comm-hook cases (same scenarios and assertions), and, because
every join test torch has for DDP needs GPUs, CPU versions of distributed_test.py's join tests
(models scaled down to 2 cores). Each runs torch's DDP first, as the oracle (it must pass the
assertions, else the scenario is wrong), then phalanx's. The groups are made by torch
(``dist.init_process_group`` as torch's tests do); the join cases run again on a group made by
phalanx.

Left out of torch's assertions: those on torch's private attributes, which phalanx's DDP does not
have (the logging data's ``join_uneven_inputs`` flag; ``_join_config``; ``_authoritative_rank``,
whose meaning, every rank ending with the last joiner's model, is checked through the models
themselves). torch's
``nn.SyncBatchNorm`` refuses CPU tensors: the sync-BN join case uses phalanx's under both DDPs.
Part 1 needs ``expecttest`` (torch's test helpers import it; in the ``test`` extra).

"""

from __future__ import annotations

import shutil

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from tests.dist import torch_hook_cases, torch_join_cases, torch_suite
from tests.harness import RankError, run_ranks
from tests.oracle import torch_lacks

pytestmark = pytest.mark.slow

WORLD = 2  # torch's DistributedDataParallelTest world size; 2 cores
GROUP_TIMEOUT_S = 120
JOIN_GROUP_TIMEOUT_S = 240  # every join case, torch's DDP and phalanx's, in one group

# ---------------------------------------------------------------------------------------------
# Part 1: torch's own test methods

# Names holding comm_hook, join or uneven: torch skips each on CPU (skip_if_lt_x_gpu(2) or the
# "cuda" feature gate); test_the_selection_holds_every_named_torch_test keeps this list whole.
TORCH_GPU_ONLY = [
    "test_ddp_comm_hook_logging",
    "test_ddp_grad_div_uneven_inputs",
    "test_ddp_join_model_equivalence",
    "test_ddp_uneven_inputs_stop_iteration_sync_bn",
    "test_ddp_uneven_inputs",
    "test_ddp_uneven_input_join_disable",
    "test_ddp_uneven_input_exception",
    "test_ddp_join_respects_forward_sync_buffers_false",
]
# DDP tests torch runs on Gloo without GPUs that register comm hooks (and their hook-less
# baseline: a hooked one failing where it passes points at the hook).
TORCH_CPU_HOOKS = [
    "test_accumulate_gradients_no_sync",
    "test_accumulate_gradients_no_sync_allreduce_hook",
    "test_accumulate_gradients_no_sync_allreduce_with_then_hook",
]
# torch's CPU tests that read _get_ddp_logging_data() (directly or through verify_ddp_error_logged)
# and pass on phalanx. test_ddp_logging_data_cpu is the other one: it asserts the keys phalanx
# leaves out (timings, torch's bucket rebuild, environment variables; docs/ddp.md).
TORCH_CPU_LOGGING = ["test_static_graph_api_cpu"]
TORCH_TESTS = TORCH_GPU_ONLY + TORCH_CPU_HOOKS + TORCH_CPU_LOGGING


def judge(problems: list[str]) -> None:
    """Fail naming every problem the ranks found."""
    assert not problems, "\n".join(problems)


def test_the_selection_holds_every_named_torch_test():
    named = torch_suite.tests_named("comm_hook", "join", "uneven")
    assert set(named) <= set(TORCH_TESTS), sorted(set(named) - set(TORCH_TESTS))


@pytest.mark.parametrize("name", TORCH_TESTS)
def test_torchs_own_test_on_phalanx_ddp(name):
    pytest.importorskip("expecttest")  # torch's test helpers import it (the [test] extra has it)
    if name not in torch_suite.tests_named(name):  # a test torch 2.13 added
        pytest.skip(f"torch {torch.__version__}'s distributed_test.py has no {name}, this check's oracle")
    temp, init_file = torch_suite.make_temp_dir()
    try:
        results = run_ranks(torch_suite.run_torch_test, WORLD, name, init_file, init=False,
                            env=torch_suite.rank_env(WORLD, temp), timeout=GROUP_TIMEOUT_S,
                            return_exceptions=True)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    judge([e.traceback or str(e) for e in results if isinstance(e, RankError)])
    status, detail = torch_suite.one_outcome(results)
    if status == "skipped":
        pytest.skip(f"torch skips it on CPU/Gloo: {detail}")
    assert not detail.startswith("0 "), f"{name} passed without building phalanx's DDP"


# ---------------------------------------------------------------------------------------------
# Part 2: our equivalents, torch's DDP as the oracle (rank side: torch_hook_cases.py, torch_join_cases.py)

# test_c10d_gloo.py's hook cases, torch's words and behaviour included
HOOK_CASES = ["future_passing_cpu", "invalid_comm_hook_init_not_callable",
              "invalid_comm_hook_init_bucket_annotation", "invalid_comm_hook_return_annotation",
              "invalid_comm_hook_return_not_future", "comm_hook_register_just_once",
              "comm_hook_sparse_gradients"]


@pytest.fixture(scope="module")
def hook_results():
    """Every rank's {case: {"torch": problems, "phalanx": problems}}: one group made by torch."""
    return run_ranks(torch_hook_cases.hook_cases, WORLD, init=False, timeout=GROUP_TIMEOUT_S)


@pytest.mark.parametrize("case", HOOK_CASES)
def test_c10d_gloo_comm_hook_case(hook_results, case):
    for rank, out in enumerate(hook_results):
        assert out[case]["torch"] == [], f"torch's DDP fails the scenario on rank {rank}: {out[case]}"
    judge([f"rank {r}: {p}" for r, out in enumerate(hook_results) for p in out[case]["phalanx"]])


def _join_params():
    return [pytest.param(case, maker, id=f"{case}-{maker}_group")
            for case in torch_join_cases.join_case_names() for maker in ("torch", "phalanx")]


@pytest.fixture(scope="module")
def join_results():
    """maker -> every rank's {case: {"torch": problems, "phalanx": problems}}: one group per
    maker of the process group runs every join case (started by the first test that needs it)."""
    groups: dict[str, list | BaseException] = {}

    def results(maker: str) -> list:
        if maker not in groups:
            try:
                groups[maker] = run_ranks(torch_join_cases.join_cases, WORLD, maker, init=(maker == "phalanx"),
                                          timeout=JOIN_GROUP_TIMEOUT_S)
            except AssertionError as e:  # a rank crashed or hung: every case of the group fails with it
                groups[maker] = e
        if isinstance(groups[maker], BaseException):
            raise AssertionError(f"the join group on a {maker}-made group failed") from groups[maker]
        return groups[maker]

    return results


@pytest.mark.parametrize("case, maker", _join_params())
def test_join_case_on_cpu(join_results, case, maker):
    results = join_results(maker)
    oracle_missing = torch_lacks(TorchDDP, "forward_sync_buffers=") if "forward_sync_buffers" in case else None
    for rank, out in enumerate(results):
        if not oracle_missing:
            assert out[case]["torch"] == [], f"torch's DDP fails the scenario on rank {rank}: {out[case]['torch']}"
    judge([f"rank {r}: {p}" for r, out in enumerate(results) for p in out[case]["phalanx"]])
    if oracle_missing:
        pytest.skip(f"phalanx's DDP passes the scenario; torch's cannot run it: {oracle_missing}")
