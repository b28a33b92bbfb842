"""StreamingDataset resumed elastically for real: a run of 3 ranks with 2 DataLoader workers
each, SIGKILLed mid-epoch, resumed from its Checkpointer at 2 ranks with 3 workers; the ids the
training loops took before the checkpoint and after the resume make one epoch, each once."""

import os
import signal

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import phalanx
from tests.harness import RankError, run_ranks

SIZES = [13, 8, 17, 9, 11]  # 58 samples: 9 global steps of 3 ranks x 2, and a tail of 4
BATCH = 2
SAVE_EVERY = 3  # batches
KILL_AFTER = 7  # batches: the checkpoint holds 6, batch 7 is taken and lost with the kill
# The harness's ranks come from a forkserver, so the DataLoader's default context there is
# forkserver too (workers re-import torch: ~12 s); fork is Linux's default for a user's script.
FORK = "fork"


def _data(directory):
    return phalanx.StreamingDataset(os.path.join(directory, "*.npy"), batch_size=BATCH,
                                    ends="uneven", seed=11, shuffle_block=16)


def _killed_run(rank, _world_size, directory):
    data = _data(directory)
    loader = DataLoader(data, batch_size=BATCH, num_workers=2, persistent_workers=True,
                        prefetch_factor=2, multiprocessing_context=FORK)
    ckpt = phalanx.Checkpointer(os.path.join(directory, "ckpt"), torch.nn.Linear(2, 2), sampler=data)
    data.set_epoch(3)
    with open(os.path.join(directory, f"taken-{rank}.txt"), "w") as log:
        for step, batch in enumerate(loader, 1):
            log.write(f"{step} {' '.join(map(str, batch[:, 0].tolist()))}\n")
            log.flush()
            if step % SAVE_EVERY == 0:
                ckpt.save(3, step, consumed=step * BATCH)
                phalanx.barrier()  # every rank's save is through before anyone dies
            if step == KILL_AFTER:
                os.kill(os.getpid(), signal.SIGKILL)
    return "not killed"


def _resumed_run(_rank, _world_size, directory):
    data = _data(directory)
    loader = DataLoader(data, batch_size=BATCH, num_workers=3, prefetch_factor=2,
                        multiprocessing_context=FORK)
    state = phalanx.Checkpointer(os.path.join(directory, "ckpt"), torch.nn.Linear(2, 2),
                                 sampler=data).load()
    data.set_epoch(state.epoch)  # the restored epoch: keeps the position
    return state.step, len(data), [i for batch in loader for i in batch[:, 0].tolist()]


@pytest.mark.slow
def test_sigkill_at_world_3_resume_at_world_2_with_other_workers(tmp_path):
    start = 0
    for i, n in enumerate(SIZES):
        np.save(tmp_path / f"shard-{i}.npy", np.arange(start, start + n, dtype=np.int64)[:, None])
        start += n
    killed = run_ranks(_killed_run, 3, str(tmp_path), return_exceptions=True)
    assert all(isinstance(r, RankError) and "exit code -9" in r.message for r in killed), killed
    saved, lost = [], []
    for rank in range(3):
        for line in (tmp_path / f"taken-{rank}.txt").read_text().splitlines():
            step, *ids = map(int, line.split())
            (saved if step <= 2 * SAVE_EVERY else lost).extend(ids)
    assert len(saved) == 3 * 2 * SAVE_EVERY * BATCH and len(lost) == 3 * BATCH

    resumed = run_ranks(_resumed_run, 2, str(tmp_path))
    assert all(step == 2 * SAVE_EVERY for step, _, _ in resumed)
    after = [i for _, _, ids in resumed for i in ids]
    assert [n for _, n, _ in resumed] == [11, 11]  # 58 - 36 over 2 ranks
    assert sorted(saved + after) == list(range(sum(SIZES)))  # one epoch, none twice
    assert set(lost) <= set(after)  # taken after the checkpoint: served again
