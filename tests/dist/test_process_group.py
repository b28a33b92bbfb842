"""Process-group set-up on real ranks: discovery, collectives helpers, and the errors."""

import random
import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import phalanx
from phalanx import comm
from phalanx.agreement import agree
from phalanx.errors import ranks_text
from tests.harness import free_port, run_ranks

_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                  "MASTER_ADDR", "MASTER_PORT")


def _many_checks(rank, world_size):
    out = {}
    out["ids"] = (phalanx.get_rank(), phalanx.get_world_size(), phalanx.get_local_rank(),
                  phalanx.get_local_world_size(), dist.get_backend(), str(phalanx.get_device()))
    phalanx.barrier()
    phalanx.barrier(async_op=True).wait()
    # `import phalanx as dist` stands in for torch.distributed: its collectives are torch's,
    # checked across ranks first
    summed = torch.tensor([float(rank + 1)])
    phalanx.all_reduce(summed, op=phalanx.ReduceOp.SUM)
    out["torch_collectives"] = (summed.item(), phalanx.all_reduce.__wrapped__ is dist.all_reduce,
                                phalanx.get_backend())
    # broadcast_tensors: rank 0's values everywhere, across dtypes and chunk boundaries
    tensors = [torch.full((3, 4), float(rank)), torch.full((5,), rank, dtype=torch.int64),
               torch.full((7,), float(rank) + 0.5, dtype=torch.float64), torch.empty(0)]
    comm.broadcast_tensors(tensors, chunk_bytes=40)
    out["broadcast"] = [t.tolist() for t in tensors[:3]]
    # all_reduce_any: true everywhere iff true somewhere
    out["any"] = (comm.all_reduce_any(rank == world_size - 1), comm.all_reduce_any(False))
    # consistent items pass; a difference raises on every rank, naming the first difference
    agree("parameters", items=[("w", (2, 3)), ("b", (3,))])
    items = [("w", (2, 3)), ("b", (3 + (rank == 1),))]
    try:
        agree("parameters", items=items)
    except phalanx.RankMismatchError as e:
        out["mismatch"] = str(e)
    out["agree"] = _agreement_verdicts(rank, world_size)
    try:
        phalanx.init_process_group()
    except phalanx.AlreadyInitializedError as e:
        out["twice"] = str(e)
    return out


def _verdict(**kwargs):
    try:
        agree("the check", **kwargs)
    except Exception as e:
        return type(e).__name__, str(e)
    return None


def _agreement_verdicts(rank, world_size):
    """agree(): each rank's problem, raised on every rank, with its type and the ranks named."""
    last = world_size - 1
    return {
        "none": _verdict(problem=None),
        "all_same": _verdict(problem=ValueError("bad lr")),
        "one_rank": _verdict(problem=phalanx.CheckpointError("no room") if rank == last else None),
        "two_kinds": _verdict(problem=TypeError(f"odd {rank % 2}")),
        # the same problem, naming an object whose address differs between ranks
        "addresses": _verdict(problem=TypeError(f"got <object object at {hex(0x7f00 + rank)}>")),
        "foreign": _verdict(problem=OSError(28, "No space left") if rank == 0 else None),
        "decided": _verdict(problem=KeyError("k") if rank == 0 else ValueError("ignored"),
                            decided_by=0),
        "decided_ok": _verdict(problem=None if rank == 0 else ValueError("ignored"), decided_by=0),
    }


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def many_checks(request):
    """(world size, every rank's results) of one group of ranks running _many_checks."""
    return request.param, run_ranks(_many_checks, request.param)


def test_ranks_sizes_backend_and_device(many_checks):
    world_size, results = many_checks
    for rank, out in enumerate(results):
        # on CPU, one host: the shared-memory backend, by its name (docs/shared_memory.md)
        assert out["ids"] == (rank, world_size, rank, world_size, "phalanx_shm", "cpu")


def test_broadcast_tensors_sends_rank_0s_values_across_dtypes_and_chunks(many_checks):
    _, results = many_checks
    for out in results:
        assert out["broadcast"] == [[[0.0] * 4] * 3, [0] * 5, [0.5] * 7]


def test_all_reduce_any_is_true_everywhere_iff_true_somewhere(many_checks):
    _, results = many_checks
    for out in results:
        assert out["any"] == (True, False)


def test_torchs_collectives_under_phalanxs_names(many_checks):
    world_size, results = many_checks
    for out in results:
        assert out["torch_collectives"] == (world_size * (world_size + 1) / 2, True, "phalanx_shm")


def test_items_that_differ_across_ranks_name_the_first_difference(many_checks):
    _, results = many_checks
    for out in results:
        assert out["mismatch"] == (
            "parameters differ across ranks: ranks 1 disagree with rank 0 (2 vs 2 entries on "
            "rank 0 and rank 1). First difference at position 1: rank 0 has 'b' (3,), "
            "rank 1 has 'b' (4,)"
        )


def test_init_twice_is_named(many_checks):
    world_size, results = many_checks
    for rank, out in enumerate(results):
        assert f"already rank {rank} of {world_size}" in out["twice"]


def test_agree_raises_each_ranks_problem_on_every_rank(many_checks):
    world_size, results = many_checks
    for rank, out in enumerate(results):
        verdicts, last = out["agree"], world_size - 1
        assert verdicts["none"] is None and verdicts["decided_ok"] is None
        assert verdicts["all_same"] == ("ValueError", "bad lr")
        assert verdicts["one_rank"] == ("CheckpointError", f"the check failed on rank {last}: no room")
        odd = ranks_text(range(1, world_size, 2))
        even = ranks_text(range(0, world_size, 2))
        assert verdicts["two_kinds"] == (
            "TypeError", f"the check failed on {even}: odd 0; on {odd}: odd 1")
        assert verdicts["addresses"] == ("TypeError", f"got <object object at {hex(0x7f00 + rank)}>")
        assert verdicts["foreign"] == (
            "RuntimeError", "the check failed on rank 0: OSError: [Errno 28] No space left")
        assert verdicts["decided"] == ("KeyError" if rank == 0 else "RuntimeError",
                                       "'k'" if rank == 0 else "KeyError: 'k'")


def _single(rank, world_size):
    env = phalanx.init_process_group()
    t = torch.ones(3)
    dist.all_reduce(t)
    phalanx.barrier()
    phalanx.destroy_process_group()
    phalanx.destroy_process_group()  # a second destroy is harmless
    return env.source, env.world_size, t.tolist(), phalanx.is_initialized()


def test_nothing_in_environment_runs_alone():
    no_launcher = {k: None for k in _LAUNCHER_VARS}
    [(source, world, summed, still)] = run_ranks(_single, 1, init=False, env=no_launcher)
    assert (source, world, summed, still) == ("single", 1, [1.0, 1.0, 1.0], False)


def _init_expecting_error(_rank, _world_size, /, timeout_s=None, **kwargs):
    if timeout_s is not None:
        kwargs["timeout"] = timedelta(seconds=timeout_s)
    try:
        phalanx.init_process_group(**kwargs)
    except Exception as e:
        return type(e).__name__, str(e)
    return None


def test_unreachable_master_names_address_port_and_timeout():
    port = free_port()  # nothing listens there
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": str(port)}
    [(kind, message)] = run_ranks(_init_expecting_error, 1, init=False, env=env, timeout_s=2)
    assert kind == "RendezvousError"
    assert f"could not reach the master at 127.0.0.1:{port} within 2 s (timeout)" in message


def test_master_port_in_use_is_named():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": str(port)}
        [(kind, message)] = run_ranks(_init_expecting_error, 1, init=False, env=env, timeout_s=2)
    assert kind == "RendezvousError"
    assert f"Rank 0 could not listen on 127.0.0.1:{port}" in message


@pytest.mark.parametrize(
    "kwargs, kind, message",
    [
        ({"backend": "glooo"}, "ValueError", "Unknown backend 'glooo': expected one of gloo, nccl"),
        ({"backend": "nccl"}, "ValueError", "Backend 'nccl' needs CUDA"),
        ({"rank": 5}, "EnvironmentConfigError", "Invalid rank 5, rank should be in the interval [0, 1]"),
        ({"backend": 3}, "TypeError", "backend must be a string or None, got int"),
    ],
)
def test_bad_arguments(kwargs, kind, message):
    [result] = run_ranks(_init_expecting_error, 1, init=False, env={"WORLD_SIZE": "2"}, **kwargs)
    assert result[0] == kind and message in result[1]


def _explicit_world_without_master(_rank, _world_size):
    return _init_expecting_error(_rank, _world_size, **{"world_size": 2, "rank": 1})


def test_explicit_world_size_without_master_is_named():
    [(kind, message)] = run_ranks(_explicit_world_without_master, 1, init=False,
                                  env={k: None for k in _LAUNCHER_VARS})
    assert kind == "ValueError"
    assert "world_size=2 needs a rendezvous: set MASTER_ADDR and MASTER_PORT" in message


def _every_init_method(rank, world_size, ports, tmp):
    """torch's explicit forms, no launcher variables: rank= and world_size= with the master in
    os.environ (torch's mp.spawn tutorial), "env://", "tcp://", "file://" and store=."""
    import os

    os.environ.update(MASTER_ADDR="localhost", MASTER_PORT=str(ports[0]))
    forms = {
        "environ": {},
        "env://": {"init_method": "env://"},
        "tcp://": {"init_method": f"tcp://127.0.0.1:{ports[1]}"},
        "file://": {"init_method": f"file://{tmp}/rendezvous"},
        "store=": {"store": dist.TCPStore("127.0.0.1", ports[2], world_size, rank == 0,
                                          timeout=timedelta(seconds=30))},
    }
    out = {}
    for name, kwargs in forms.items():
        joined = phalanx.init_process_group("gloo", rank=rank, world_size=world_size, **kwargs)
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        out[name] = (joined.source, joined.rank, dist.get_rank(), dist.get_world_size(), t.item())
        phalanx.destroy_process_group()
        if name == "environ":  # a new group on the same port: rank 0's store must be gone
            os.environ["MASTER_PORT"] = str(ports[3])
    out["half"] = _init_expecting_error(rank, world_size, world_size=world_size)
    return out


@pytest.fixture(scope="module")
def every_init_method(tmp_path_factory):
    """Every rank's results of one group of 2 ranks running _every_init_method."""
    ports = [free_port() for _ in range(4)]
    tmp_path = tmp_path_factory.mktemp("init_methods")
    return run_ranks(_every_init_method, 2, ports, str(tmp_path), init=False,
                     env={k: None for k in _LAUNCHER_VARS})


@pytest.mark.parametrize("name", ["environ", "env://", "tcp://", "file://", "store="])
def test_explicit_rank_and_world_size_with_every_init_method(every_init_method, name):
    for rank, out in enumerate(every_init_method):
        assert out[name] == ("arguments", rank, rank, 2, 3.0), (name, out[name])


def test_world_size_without_rank_is_named(every_init_method):
    for out in every_init_method:
        assert out["half"] == (
            "EnvironmentConfigError", "init_process_group() got world_size= but no rank=, and "
            "RANK is not set in the environment; pass both rank= and world_size=")


def _slurm_rank(rank, world_size):
    env = phalanx.init_process_group()
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return env.source, env.rank, env.world_size, env.local_rank, env.master_port, t.item()


def _free_slurm_port() -> int:
    """A free port that env.py derives from some SLURM_JOB_ID (15000 + id % 20000)."""
    for port in random.sample(range(15000, 35000), 100):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in [15000, 35000)")


def test_srun_without_launcher():
    port = _free_slurm_port()
    job_id = port - 15000
    def slurm_env(rank):
        env = {k: None for k in _LAUNCHER_VARS}
        env.update(SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_LOCALID=str(rank),
                   SLURM_NODEID="0", SLURM_TASKS_PER_NODE="2",
                   SLURM_JOB_NODELIST="127.0.0.1", SLURM_JOB_ID=str(job_id))
        return env
    results = run_ranks(_slurm_rank, 2, init=False, env=slurm_env)
    assert results == [("slurm", r, 2, r, port, 1.0) for r in range(2)]


@pytest.mark.slow  # both ranks wait out the rendezvous timeout
def test_a_rank_that_never_joins_is_named():
    # a world of 3 in which only ranks 0 and 2 start: both name rank 1 after the timeout
    port = free_port()
    env = {"WORLD_SIZE": "3", "MASTER_PORT": str(port)}
    results = run_ranks(_init_expecting_error, 2, init=False, timeout_s=2,
                        env=lambda r: {**env, "RANK": str(2 * r), "LOCAL_RANK": "0"})
    for rank, (kind, message) in zip((0, 2), results):
        assert kind == "RendezvousError"
        assert message.startswith(f"Rank 1 of 3 did not join at 127.0.0.1:{port} within 2 s "
                                  f"(timeout); rank {rank} gave up waiting")
