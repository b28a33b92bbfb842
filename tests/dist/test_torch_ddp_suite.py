"""torch's own CPU DDP tests of comm hooks and join, on phalanx's DistributedDataParallel (issue 21).

Part 1 runs torch's test methods themselves, from the installed
``torch/testing/_internal/distributed/distributed_test.py`` (``DistributedTest._DistTestBase``),
each in its own group of 2 ranks on Gloo as torch's ``test_distributed_spawn.py`` runs them, with
phalanx's class in place of torch's (:mod:`tests.dist.torch_suite`). :data:`TORCH_TESTS` is the
selection: every test whose name holds ``comm_hook``, ``join`` or ``uneven`` (torch runs them
all on GPUs only: they are skipped here with torch's own reason) and the DDP tests that run on
Gloo without GPUs and register a comm hook.

Part 2 is our own code for what torch's wheel does not ship: ``test/distributed/test_c10d_gloo.py``'s
``DistributedDataParallelTest`` comm-hook cases (same scenarios and assertions), and, because
every join test torch has for DDP needs GPUs, CPU versions of distributed_test.py's join tests
(models scaled down to 2 cores). Each runs torch's DDP first, as the oracle (it must pass the
assertions, else the scenario is wrong), then phalanx's. The groups are made by torch
(``dist.init_process_group`` as torch's tests do); the join cases run again on a group made by
phalanx, where phalanx's join works today.

Left out of torch's assertions: those on torch's private attributes, which phalanx's DDP does not
have (``_get_ddp_logging_data()``, refused by design, behind ``verify_ddp_error_logged`` and the
``join_uneven_inputs`` flag; ``_join_config``; ``_authoritative_rank``, whose meaning, every rank
ending with the last joiner's model, is checked through the models themselves). torch's
``nn.SyncBatchNorm`` refuses CPU tensors: the sync-BN join case uses phalanx's under both DDPs.
Part 1 needs ``expecttest`` (torch's test helpers import it; in the ``test`` extra).

Known gaps are ``xfail(strict=True, raises=KnownGap)``: the test raises :class:`KnownGap` only
when the failure shows the cause the mark names, so another failure still fails, and a pass
fails as XPASS until the mark is removed.
"""

from __future__ import annotations

import re
import shutil

import pytest

from tests.dist import torch_hook_cases, torch_join_cases, torch_suite
from tests.harness import RankError, run_ranks

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
TORCH_TESTS = TORCH_GPU_ONLY + TORCH_CPU_HOOKS


class KnownGap(AssertionError):
    """A failure showing the cause its test's xfail names."""


def known_gap(cause: str, reason: str):
    """The xfail of a gap whose failure matches the regular expression ``cause``."""
    return pytest.mark.xfail(strict=True, raises=KnownGap, reason=f"{reason} [cause: /{cause}/]")


def judge(problems: list[str], request: pytest.FixtureRequest) -> None:
    """Fail with ``problems``; as :class:`KnownGap` when each shows the cause of the test's xfail
    (one problem of another kind fails the test outright)."""
    if not problems:
        return
    text = "\n".join(problems)
    mark = request.node.get_closest_marker("xfail")
    cause = re.search(r"\[cause: /(.*)/\]$", mark.kwargs["reason"], re.S) if mark else None
    if cause is not None and all(re.search(cause.group(1), p) for p in problems):
        raise KnownGap(text)
    raise AssertionError(text)


def test_the_selection_holds_every_named_torch_test():
    named = torch_suite.tests_named("comm_hook", "join", "uneven")
    assert set(named) <= set(TORCH_TESTS), sorted(set(named) - set(TORCH_TESTS))


@pytest.mark.parametrize("name", TORCH_TESTS)
def test_torchs_own_test_on_phalanx_ddp(name, request):
    pytest.importorskip("expecttest")  # torch's test helpers import it (the [test] extra has it)
    temp, init_file = torch_suite.make_temp_dir()
    try:
        results = run_ranks(torch_suite.run_torch_test, WORLD, name, init_file, init=False,
                            env=torch_suite.rank_env(WORLD, temp), timeout=GROUP_TIMEOUT_S,
                            return_exceptions=True)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    judge([e.traceback or str(e) for e in results if isinstance(e, RankError)], request)
    status, detail = torch_suite.one_outcome(results)
    if status == "skipped":
        pytest.skip(f"torch skips it on CPU/Gloo: {detail}")
    assert not detail.startswith("0 "), f"{name} passed without building phalanx's DDP"


# ---------------------------------------------------------------------------------------------
# Part 2: our equivalents, torch's DDP as the oracle (rank side: torch_hook_cases.py, torch_join_cases.py)

# torch's words for the hook-API mistakes (test_c10d_gloo.py), as the problems quote them
NOT_CALLABLE = r"expected TypeError /Communication hook must be callable\./"
BUCKET_ANNOTATION = r"expected ValueError /bucket annotation should be dist\.GradBucket\./"
RETURN_ANNOTATION = r"expected ValueError /Communication hook: return annotation should be torch\.futures\.Future/"
NOT_A_FUTURE = r"expected RuntimeError /callback must return a torch\.futures\.Future object, but got/"
TWICE = r"expected RuntimeError /register_comm_hook or register_builtin_comm_hook can only be called once\./"
SPARSE_HOOK = r"UsageError: register_comm_hook with sparse gradients"

HOOK_CASES = [
    pytest.param("future_passing_cpu", id="future_passing_cpu"),
    pytest.param("invalid_comm_hook_init_not_callable", marks=known_gap(
        NOT_CALLABLE, "hook API wording: phalanx says 'a communication hook must be callable as "
        "hook(state, bucket) -> Future' (comm_hook.check_hook), not torch's message"),
        id="invalid_comm_hook_init_not_callable"),
    pytest.param("invalid_comm_hook_init_bucket_annotation", marks=known_gap(
        BUCKET_ANNOTATION, "hook API: phalanx does not check the bucket annotation; torch raises "
        "ValueError 'bucket annotation should be dist.GradBucket.'"),
        id="invalid_comm_hook_init_bucket_annotation"),
    pytest.param("invalid_comm_hook_return_annotation", marks=known_gap(
        RETURN_ANNOTATION, "hook API: phalanx does not check the return annotation; torch raises "
        "ValueError 'Communication hook: return annotation should be torch.futures.Future'"),
        id="invalid_comm_hook_return_annotation"),
    pytest.param("invalid_comm_hook_return_not_future", marks=known_gap(
        NOT_A_FUTURE, "hook API: a hook returning 1 makes phalanx's backward raise TypeError 'the "
        "communication hook ... must return a torch.futures.Future, got int' (comm_hook.HookComm."
        "launch); torch raises RuntimeError 'callback must return a torch.futures.Future object, "
        "but got ...'"), id="invalid_comm_hook_return_not_future"),
    pytest.param("comm_hook_register_just_once", marks=known_gap(
        TWICE, "hook API wording: phalanx raises UsageError 'register_comm_hook can be called once "
        "per DistributedDataParallel (as in torch); ...' (comm_hook.check_registration), not "
        "torch's 'register_comm_hook or register_builtin_comm_hook can only be called once.'"),
        id="comm_hook_register_just_once"),
    pytest.param("comm_hook_sparse_gradients", marks=known_gap(
        SPARSE_HOOK, "hook API: phalanx refuses a comm hook on a model with sparse gradients "
        "(comm_hook.check_registration: 'register_comm_hook with sparse gradients'); torch runs "
        "the hook on the sparse gradient"), id="comm_hook_sparse_gradients"),
]


@pytest.fixture(scope="module")
def hook_results():
    """Every rank's {case: {"torch": problems, "phalanx": problems}}: one group made by torch."""
    return run_ranks(torch_hook_cases.hook_cases, WORLD, init=False, timeout=GROUP_TIMEOUT_S)


@pytest.mark.parametrize("case", HOOK_CASES)
def test_c10d_gloo_comm_hook_case(hook_results, case, request):
    for rank, out in enumerate(hook_results):
        assert out[case]["torch"] == [], f"torch's DDP fails the scenario on rank {rank}: {out[case]}"
    judge([f"rank {r}: {p}" for r, out in enumerate(hook_results) for p in out[case]["phalanx"]], request)


# Join on a group torch made: phalanx's Join asks for phalanx's diagnostics (uneven.py, Join.__enter__)
JOIN_ON_TORCH_GROUP = r"UsageError: Join needs phalanx's diagnostics"
_ON_TORCH_GROUP = known_gap(
    JOIN_ON_TORCH_GROUP, "join on a torch-made group: phalanx.Join.__enter__ raises UsageError "
    "\"Join needs phalanx's diagnostics\" when monitor.current() is None (no phalanx "
    "init_process_group); flip when the ledger serves any process group")
# throw_on_early_termination: torch's words are "Rank {r} exhausted all inputs" on the ranks that
# ran out and "Detected at least one rank that exhausted inputs." on the others
EARLY_WORDS = (r"expected RuntimeError /(Rank \d exhausted all inputs"
               r"|Detected at least one rank that exhausted inputs\.)/")
_EARLY_WORDING = known_gap(
    EARLY_WORDS, "join wording: phalanx's EarlyTerminationError says 'Rank(s) N ran out of inputs "
    "before the others (throw_on_early_termination=True) ...' (uneven.early_termination), not "
    "torch's 'Rank N exhausted all inputs' / 'Detected at least one rank that exhausted inputs.'")

# A joined rank's .grad: torch's join hook all-reduces zero buckets and leaves the joined rank's
# .grad alone (_match_all_reduce_for_bwd_pass); phalanx's shadow writes the average into it
# (ddp/joining.py, _shadow_bucket), so a rank that leaves a join without zero_grad() starts the
# next backward from that average: torch's test sees it at the second join's first step.
GRAD_AFTER_JOIN = r"divide by initial, step 0: Tensor-likes are not close"
_GRAD_AFTER_JOIN = known_gap(
    GRAD_AFTER_JOIN, "join: phalanx writes the shadowed average into a joined rank's .grad "
    "(ddp/joining.py _shadow_bucket's _write_back), torch leaves it untouched; the joined rank's "
    "next backward (second join, step 0) accumulates onto it: 75 instead of 50")


def _phalanx_group_marks(case: str) -> list:
    if case.endswith(",throw]") or case == "ddp_uneven_inputs_stop_iteration_sync_bn":
        return [_EARLY_WORDING]
    return [_GRAD_AFTER_JOIN] if case == "ddp_grad_div_uneven_inputs" else []


def _join_params():
    out = []
    for case in torch_join_cases.join_case_names():
        torch_marks = [] if case == "ddp_uneven_input_join_disable" else [_ON_TORCH_GROUP]
        out.append(pytest.param(case, "torch", marks=torch_marks, id=f"{case}-torch_group"))
        out.append(pytest.param(case, "phalanx", marks=_phalanx_group_marks(case), id=f"{case}-phalanx_group"))
    return out


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
def test_join_case_on_cpu(join_results, case, maker, request):
    results = join_results(maker)
    for rank, out in enumerate(results):
        assert out[case]["torch"] == [], f"torch's DDP fails the scenario on rank {rank}: {out[case]['torch']}"
    judge([f"rank {r}: {p}" for r, out in enumerate(results) for p in out[case]["phalanx"]], request)
