"""Checkpointer on real ranks: one writer, per-rank RNG, errors raised on every rank,
resume at another world size, preemption agreed by all ranks."""

import os
import random
import signal

import numpy as np
import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import phalanx
from phalanx.checkpoint import checkpointer as checkpoint_module
from phalanx.checkpoint import Checkpointer, PreemptionHandler, read_checkpoint
from phalanx.errors import PREEMPTED_EXIT_CODE
from tests.harness import error_of, run_ranks


def _draws():
    return torch.rand(3).tolist(), random.random(), float(np.random.rand())


def _seed(rank):
    torch.manual_seed(100 + rank)
    random.seed(200 + rank)
    np.random.seed(300 + rank)


def _protocol(rank, world_size, directory, wrapper):
    out = {}
    writes = []
    original = checkpoint_module.write_checkpoint
    checkpoint_module.write_checkpoint = lambda *a: writes.append(a[0]) or original(*a)
    _seed(rank)
    wrap = TorchDDP if wrapper == "torch" else phalanx.DistributedDataParallel
    model = wrap(torch.nn.Linear(4, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    ckpt = Checkpointer(directory, model, optimizer)
    out["path"] = str(ckpt.save(1, 5, extra={"rank0_says": rank}))
    out["writes"] = len(writes)
    out["draws"] = _draws()
    out["params"] = [p.tolist() for p in model.parameters()]
    _seed(rank + 50)  # wander off: other RNG states, other parameters
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    state = ckpt.load()
    out["state"] = (state.epoch, state.step, state.world_size, state.extra)
    out["restored_draws"] = _draws()
    out["restored_params"] = [p.tolist() for p in model.parameters()]

    # errors: the same exception type on every rank, nobody left waiting
    out["step_mismatch"] = error_of(ckpt.save, 1, 6 + (rank == world_size - 1))
    out["bad_extra"] = error_of(ckpt.save, 1, 7, extra={"f": print} if rank == 0 else {})
    blocked = os.path.join(directory, "a_file")
    if rank == 0:
        open(blocked, "w").close()
    out["write_fails"] = error_of(Checkpointer(blocked, model).save, 1, 8)
    narrow = torch.nn.Linear(4, 2 if rank == 1 else 3)
    out["one_rank_misfits"] = error_of(Checkpointer(directory, narrow).load)
    out["missing"] = error_of(ckpt.load, os.path.join(directory, "nope.ckpt"))
    out["files"] = sorted(os.listdir(directory))
    return out


# torch's DDP imports torch._dynamo (seconds of CPU): one world size each keeps it cheap
@pytest.fixture(scope="module", params=[(2, "torch"), (3, "phalanx")], ids=["world2-torch", "world3-phalanx"])
def protocol(request, tmp_path_factory):
    """(world size, directory, every rank's results) of one group of ranks running _protocol."""
    world_size, wrapper = request.param
    directory = str(tmp_path_factory.mktemp("protocol"))
    return world_size, directory, run_ranks(_protocol, world_size, directory, wrapper)


def test_the_file_holds_the_bare_module_every_ranks_rng_and_rank_0s_extra(protocol):
    world_size, directory, _ = protocol
    path = os.path.join(directory, "ckpt-000000000005.ckpt")
    saved = read_checkpoint(path)
    assert not any(k.startswith("module.") for k in saved["model"])
    assert len(saved["rng"]) == world_size and saved["extra"] == {"rank0_says": 0}


def test_rank_0_alone_writes_and_every_rank_gets_the_path(protocol):
    _, directory, results = protocol
    path = os.path.join(directory, "ckpt-000000000005.ckpt")
    for rank, out in enumerate(results):
        assert out["path"] == path
        assert out["writes"] == (1 if rank == 0 else 0)


def test_load_restores_the_state_the_parameters_and_each_ranks_rng(protocol):
    world_size, _, results = protocol
    for out in results:
        assert out["state"] == (1, 5, world_size, {"rank0_says": 0})
        assert out["restored_draws"] == out["draws"]
        assert out["restored_params"] == out["params"]
    # every rank drew its own numbers: the RNG states really are per rank
    assert len({str(out["draws"]) for out in results}) == world_size


def test_a_step_that_differs_across_ranks_is_named_on_every_rank(protocol):
    world_size, _, results = protocol
    last = world_size - 1
    for out in results:
        assert out["step_mismatch"] == ("RankMismatchError", (
            f"save(epoch, step) differs across ranks: ranks {last} disagree with rank 0, which "
            f"has epoch=1, step=6; rank {last} has epoch=1, step=7"))


def test_an_extra_that_cannot_be_checkpointed_is_named_on_every_rank(protocol):
    _, _, results = protocol
    for out in results:
        assert out["bad_extra"][0] == "TypeError"
        assert out["bad_extra"][1].startswith("Cannot checkpoint extra['f']: it is a builtins.")


def test_a_failed_write_is_named_on_every_rank(protocol):
    _, directory, results = protocol
    for out in results:
        kind, message = out["write_fails"]
        assert kind == "CheckpointError" and message.startswith(
            f"Saving checkpoint {directory}/a_file/ckpt-000000000008.ckpt failed on rank 0: ")


def test_a_model_that_does_not_fit_on_one_rank_is_named_on_every_rank(protocol):
    _, directory, results = protocol
    path = os.path.join(directory, "ckpt-000000000005.ckpt")
    for out in results:
        kind, message = out["one_rank_misfits"]
        assert kind == "CheckpointError" and message == (
            f"Loading {path} failed on rank 1: Checkpoint {path} does not fit the model: "
            "'weight' has shape (3, 4) in the checkpoint and (2, 4) in the model")


def test_a_missing_checkpoint_is_named_and_nothing_else_is_written(protocol):
    _, directory, results = protocol
    for out in results:
        assert out["missing"] == ("CheckpointError",
                                  f"Checkpoint {directory}/nope.ckpt does not exist")
        assert out["files"] == ["a_file", "ckpt-000000000005.ckpt"]


def _sharded(seed):
    torch.manual_seed(seed)
    model = phalanx.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 4), torch.nn.Linear(4, 1)))
    optimizer = phalanx.ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=0.1)
    return model, optimizer


def _consume_then_save(rank, world_size, directory, length, per_rank):
    model, optimizer = _sharded(0)
    model(torch.randn(3, 6)).sum().backward()
    optimizer.step()
    _seed(rank)
    sampler = phalanx.DistributedSampler(range(length), seed=5)
    sampler.set_epoch(3)
    it = iter(sampler)
    taken = [next(it) for _ in range(per_rank)]
    # the single file (phalanx's ZeRO defaults to the sharded format): read back below
    Checkpointer(directory, model, optimizer, sampler=sampler, format="consolidated").save(3, per_rank)
    return taken, _draws()


def _resume_rest(rank, world_size, directory):
    model, optimizer = _sharded(1)
    sampler = phalanx.DistributedSampler(range(32), seed=5)
    ckpt = Checkpointer(directory, model, optimizer, sampler=sampler)
    _seed(rank)
    own = _draws()
    _seed(rank)
    state = ckpt.load()
    draws = _draws()
    sampler.set_epoch(state.epoch)
    optimizer.consolidate_state_dict(to=0)
    full = optimizer.state_dict()["state"] if rank == 0 else None
    as_lists = full and {i: {k: v.tolist() for k, v in s.items()} for i, s in full.items()}
    params = [p.tolist() for p in model.parameters()]
    return list(sampler), draws, own, state.world_size, as_lists, params


def test_resume_from_two_ranks_on_three(tmp_path):
    directory = str(tmp_path)
    before = run_ranks(_consume_then_save, 2, directory, 32, 4)
    after = run_ranks(_resume_rest, 3, directory)
    order = torch.randperm(32, generator=torch.Generator().manual_seed(5 + 3)).tolist()
    assert [before[r][0][i] for i in range(4) for r in range(2)] == order[:8]
    # the rest of the epoch, in the same global order, dealt round-robin to three ranks
    assert [after[r][0] for r in range(3)] == [order[8 + r :: 3] for r in range(3)]
    served = [i for taken, *_ in before for i in taken] + [i for rest, *_ in after for i in rest]
    assert sorted(served) == list(range(32))
    # ranks 0 and 1 continue their own RNG streams; the new rank 2 keeps what it seeded
    assert after[0][1] == before[0][1] and after[1][1] == before[1][1]
    assert after[2][1] == after[2][2]
    assert {a[3] for a in after} == {2}
    # the ZeRO state saved from 2 shards, reloaded into 3 shards and gathered again: the same
    saved = read_checkpoint(os.path.join(directory, "ckpt-000000000004.ckpt"))
    assert list(saved["model"]) == [f"{i}.{p}" for i in range(3) for p in ("weight", "bias")]
    optimizer = saved["optimizer"]
    assert optimizer["zero"]["world_size"] == 2 and len(optimizer["state"]) == 6
    expected = {i: {k: v.tolist() for k, v in s.items()} for i, s in optimizer["state"].items()}
    assert after[0][4] == expected
    assert all(a[5] == [p.tolist() for p in saved["model"].values()] for a in after)


def _preempt(rank, world_size, directory, sender, signum, check_every):
    previous = signal.getsignal(signal.SIGTERM)
    model = torch.nn.Linear(2, 2)
    ckpt = Checkpointer(directory, model)
    stopped_at, code = None, None
    with PreemptionHandler(check_every=check_every) as preemption:
        for step in range(1, 20):
            if step == 4 and rank == sender:
                os.kill(os.getpid(), signum)
            if preemption.should_stop():
                stopped_at = step
                ckpt.save(0, step)
                try:
                    preemption.exit()
                except SystemExit as e:
                    code = e.code
                break
    received = preemption.received.name if preemption.received else None
    return stopped_at, code, received, signal.getsignal(signal.SIGTERM) is previous


@pytest.mark.parametrize("sender, signum, check_every, stop", [
    (1, signal.SIGTERM, 1, 4),  # every step: the very boundary after the signal
    (0, signal.SIGUSR1, 3, 6),  # every 3rd call: the next check, step 6
    (2, signal.SIGINT, 1, 4),  # Ctrl-C on one rank: every rank saves, then exits 130
])
def test_preemption_agreed_by_every_rank(tmp_path, sender, signum, check_every, stop):
    directory = str(tmp_path)
    results = run_ranks(_preempt, 3, directory, sender, signum, check_every)
    expected = 130 if signum == signal.SIGINT else PREEMPTED_EXIT_CODE
    for rank, (stopped_at, code, received, restored) in enumerate(results):
        assert (stopped_at, code, restored) == (stop, expected, True)
        assert received == (signal.Signals(signum).name if rank == sender else None)
    assert os.listdir(directory) == [f"ckpt-{stop:012d}.ckpt"]


def _cuda_round_trip(rank, world_size, directory):
    phalanx.init_process_group(backend="nccl")
    try:
        device = phalanx.get_device()
        torch.manual_seed(rank)
        model = phalanx.DistributedDataParallel(torch.nn.Linear(4, 4).to(device),
                                                device_ids=[device.index])
        optimizer = torch.optim.Adam(model.parameters())
        model(torch.randn(2, 4, device=device)).sum().backward()
        optimizer.step()
        ckpt = Checkpointer(directory, model, optimizer)
        path = ckpt.save(0, 1)
        expected = torch.rand(3, device=device).tolist()
        with PreemptionHandler() as preemption:  # its flag travels on a Gloo side group
            stop = preemption.should_stop()
        ckpt.load()
        restored = torch.rand(3, device=device).tolist() == expected
        mapped = read_checkpoint(path, map_location=ckpt.map_location)["model"]["weight"].device
        return str(ckpt.map_location), str(mapped), restored, stop
    finally:
        phalanx.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs for NCCL")
def test_cuda_each_rank_loads_onto_its_own_device(tmp_path):
    results = run_ranks(_cuda_round_trip, 2, str(tmp_path), init=False)
    assert results == [(f"cuda:{r}", f"cuda:{r}", True, False) for r in range(2)]
