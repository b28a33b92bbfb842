"""Run one of torch's own DDP test methods (``DistributedTest._DistTestBase`` of the installed
``torch/testing/_internal/distributed/distributed_test.py``) on phalanx's DistributedDataParallel.

What torch's ``test/distributed/test_distributed_spawn.py`` does for one test, minus the
``spawn`` start (the ranks come from :func:`tests.harness.run_ranks`' forkserver, which has
torch imported already) and with phalanx's class in place of torch's:

* the parent makes ``TEMP_DIR`` with its ``barrier``, ``test_dir`` and ``init_dir`` folders
  (torch's ``initialize_temp_directories``) and an empty init file (``MultiProcessTestCase.setUp``);
* each rank sets ``BACKEND``, ``WORLD_SIZE``, ``TEMP_DIR`` and ``INIT_METHOD`` before importing
  ``distributed_test`` (it reads them at import), replaces ``torch.nn.parallel.DistributedDataParallel``
  and ``distributed_test``'s own ``DistributedDataParallel`` global with phalanx's class, and runs
  ``TestDistBackend._run``'s steps: the test case built for the method, ``dist.init_process_group``
  on the init file (torch-made group, Gloo), torch's file barrier, the method, the barrier again,
  ``destroy_process_group``.

A skip is reported as torch reports it: a method marked ``__unittest_skip__`` is not run, a
``unittest.SkipTest`` or a ``sys.exit`` with one of ``TEST_SKIPS``' exit codes (how
``skip_if_lt_x_gpu`` skips inside a rank) becomes ``("skipped", torch's message)``.
"""

from __future__ import annotations

import ast
import os
import re
import tempfile
import unittest
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

BACKEND = "gloo"
# torch's distributed_test.default_pg_timeout is 60 s; a hang here should fail sooner than the
# harness' own timeout, so that Gloo names the collective.
PG_TIMEOUT_S = 45


def distributed_test_path() -> Path:
    """The installed ``distributed_test.py`` (read as text: importing it needs the env vars)."""
    return Path(torch.__file__).parent / "testing" / "_internal" / "distributed" / "distributed_test.py"


def tests_named(*words: str) -> list[str]:
    """``_DistTestBase``'s test methods whose names contain one of ``words``, in file order."""
    tree = ast.parse(distributed_test_path().read_text())
    base = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "_DistTestBase")
    return [f.name for f in base.body if isinstance(f, ast.FunctionDef) and f.name.startswith("test_")
            and any(w in f.name for w in words)]


def make_temp_dir() -> tuple[str, str]:
    """(TEMP_DIR, init file) laid out as torch's ``setUp`` lays them; the caller removes it."""
    temp = tempfile.mkdtemp(prefix="phalanx-torchsuite-")
    for sub in ("barrier", "test_dir", "init_dir"):
        os.mkdir(os.path.join(temp, sub))
    init_file = os.path.join(temp, "init_file")
    Path(init_file).touch()
    return temp, init_file


def rank_env(world_size: int, temp: str) -> dict[str, str]:
    """What ``distributed_test`` reads at import, as torch's runner sets it."""
    return {
        "BACKEND": BACKEND,
        "WORLD_SIZE": str(world_size),
        "TEMP_DIR": temp,
        "INIT_METHOD": "file://" + os.path.join(temp, "init_dir", "shared_init_file"),
    }


def use_phalanx_ddp(dt: Any) -> list[Any]:
    """Every way ``distributed_test`` names torch's DDP now names phalanx's: the module global
    (``from torch.nn.parallel import DistributedDataParallel``) and the package attribute behind
    ``nn.parallel.DistributedDataParallel`` / ``torch.nn.parallel.DistributedDataParallel``. The
    class in ``torch.nn.parallel.distributed`` stays torch's, for torch's own isinstance checks,
    but building one raises: a test that reached torch's DDP some other way must not pass.
    Returns the list that collects every phalanx DDP built from then on (proof it ran on it)."""
    import phalanx

    ours = phalanx.DistributedDataParallel
    built: list[Any] = []
    original = ours.__init__

    def counted(self: Any, *args: Any, **kwargs: Any) -> None:
        built.append(type(self))
        original(self, *args, **kwargs)

    def refused(self: Any, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("torch's own DistributedDataParallel was built inside torch's suite "
                             "on phalanx: a path the substitution does not cover")

    ours.__init__ = counted  # this rank's process only
    torch.nn.parallel.distributed.DistributedDataParallel.__init__ = refused
    torch.nn.parallel.DistributedDataParallel = ours
    dt.DistributedDataParallel = ours
    return built


def _skip_message(code: Any) -> str | None:
    from torch.testing._internal.common_distributed import TEST_SKIPS

    return next((s.message for s in TEST_SKIPS.values() if s.exit_code == code), None)


def run_torch_test(rank: int, world_size: int, name: str, init_file: str) -> tuple[str, str]:
    """In a rank of :func:`tests.harness.run_ranks` (``init=False``, env from :func:`rank_env`):
    run torch's test ``name`` on phalanx's DDP; ``("passed", "N phalanx DistributedDataParallel
    built")`` or ``("skipped", why)``.
    A failure raises, with torch's assertion and traceback."""
    import torch.distributed as dist
    from torch.testing._internal import common_utils
    from torch.testing._internal.distributed import distributed_test as dt

    built = use_phalanx_ddp(dt)

    class TestDistBackendWithSpawn(dt.TestDistBackend, dt.DistributedTest._DistTestBase):
        pass  # test_distributed_spawn.py's class, without its setUp (the parent's part)

    method = getattr(TestDistBackendWithSpawn, name)
    if getattr(method, "__unittest_skip__", False):  # unittest would not start it
        return "skipped", method.__unittest_skip_why__
    case = TestDistBackendWithSpawn(name)
    case.rank, case.file_name = rank, init_file
    dist.init_process_group(init_method=f"file://{init_file}", backend=BACKEND, world_size=world_size,
                            rank=rank, timeout=timedelta(seconds=PG_TIMEOUT_S))
    try:
        case._barrier()
        common_utils.set_rng_seed()  # MultiProcessTestCase.run_test does it before the method
        try:
            getattr(case, name)()
        except unittest.SkipTest as skip:
            return "skipped", str(skip)
        except SystemExit as e:  # skip_if_lt_x_gpu & co. exit with a TEST_SKIPS code
            why = _skip_message(e.code)
            if why is None:
                raise
            return "skipped", why
        case._barrier()
        return "passed", f"{len(built)} phalanx DistributedDataParallel built"
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def one_outcome(results: list[tuple[str, str]]) -> tuple[str, str]:
    """The ranks' common outcome; ranks that disagree (one skipped, one passed) fail the test."""
    if len(set(results)) != 1:
        raise AssertionError(f"ranks disagree on the outcome: {results}")
    return results[0]


def failure_matches(error_text: str, cause: str) -> bool:
    """Whether a failing group's report shows ``cause`` (a regular expression)."""
    return re.search(cause, error_text) is not None


# ---------------------------------------------------------------------------------------------
# Shared by our equivalents of torch's scenarios (torch_hook_cases.py, torch_join_cases.py).
# Each scenario runs with a DDP class (torch's, then phalanx's) and returns the list of torch's
# assertions it broke, worded "<what>: <how>" (empty: it passed); an exception is one problem,
# "<Type>: <message>".


def ddp_classes() -> dict[str, type]:
    """The DDPs a scenario runs with, the oracle first."""
    import phalanx

    return {"torch": TorchDDP, "phalanx": phalanx.DistributedDataParallel}


def described(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def raises(fn: Callable[[], Any], kind: type, pattern: str) -> list[str]:
    """assertRaisesRegex's rule: ``fn`` raises ``kind`` with a message ``pattern`` searches."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - what it raised is the finding
        return [] if isinstance(e, kind) and re.search(pattern, str(e)) else [
            f"expected {kind.__name__} /{pattern}/, got {described(e)}"]
    return [f"expected {kind.__name__} /{pattern}/, nothing raised"]


def differs(what: str, actual: torch.Tensor, expected: torch.Tensor) -> list[str]:
    """torch's TestCase.assertEqual on tensors: assert_close's tolerances, NaN equal to NaN."""
    try:
        torch.testing.assert_close(actual, expected, equal_nan=True)
    except AssertionError as e:
        return [f"{what}: {e}".replace("\n", " ")]
    return []


def torch_group(rank: int, world_size: int) -> dist.ProcessGroup:
    """The default group as torch's tests make it (``_get_process_group``): torch's own call."""
    dist.init_process_group(backend="gloo", rank=rank, world_size=world_size)  # env:// of the harness
    return dist.distributed_c10d._get_default_group()



class Task(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.ones(2, 2))

    def forward(self, x):
        return self.p + x
