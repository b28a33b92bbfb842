"""Exact resume under ``phalanx run``: after a SIGKILL, after preemption, and on more ranks.

Every run trains ``scripts/ckpt_train.py`` (phalanx DDP, Adam, StepLR, dropout with per-rank
RNG streams, phalanx's DistributedSampler, 96 samples, 12 steps per epoch on 2 ranks, 2
epochs) and logs each sample it trains on. A run that was interrupted and resumed must end
bit-identical to the uninterrupted one, and its log, cut where each resume went back to,
must hold every sample of every epoch exactly once.
"""

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from phalanx.checkpoint import read_checkpoint
from phalanx.checkpoint.file import list_checkpoints
from phalanx.errors import PREEMPTED_EXIT_CODE

pytestmark = pytest.mark.slow  # launcher runs training for real, killed and resumed

SCRIPT = Path(__file__).resolve().parent / "scripts" / "ckpt_train.py"
SAMPLES, STEPS_PER_EPOCH, EPOCHS = 96, 12, 2  # the script's defaults, on 2 ranks
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                  "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT")


def _command(directory, *script_args, nproc=2, max_restarts=0):
    return [sys.executable, "-m", "phalanx", "run", "--standalone", "--nproc-per-node",
            str(nproc), "--max-restarts", str(max_restarts), str(SCRIPT), "--dir",
            str(directory), *map(str, script_args)]


def _start(*args, **kwargs):
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
    return subprocess.Popen(_command(*args, **kwargs), env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _run(*args, **kwargs):
    proc = _start(*args, **kwargs)
    try:
        out, _ = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"phalanx run did not finish: {proc.communicate()[0]}")
    return proc.returncode, out


def _segments(directory, rank):
    """The rank's log as [(resumed_after_step, [(epoch, step, index), ...]), ...] in order."""
    segments = []
    for line in (Path(directory) / f"samples.rank{rank}.log").read_text().splitlines():
        kind, *fields = line.split()
        if kind == "R":
            segments.append((int(fields[1]), []))
        else:
            segments[-1][1].append(tuple(int(f) for f in fields[1:]))
    return segments


def _effective(directory, rank):
    """Samples whose updates are in the final state: each segment up to where the next resumed."""
    segments = _segments(directory, rank)
    kept = []
    for i, (_, samples) in enumerate(segments):
        cut = segments[i + 1][0] if i + 1 < len(segments) else float("inf")
        kept += [s for s in samples if s[1] <= cut]
    return kept


def _assert_each_sample_once_per_epoch(directory, ranks):
    taken = [s for rank in range(ranks) for s in _effective(directory, rank)]
    for epoch in range(EPOCHS):
        indices = sorted(index for e, _, index in taken if e == epoch)
        assert indices == list(range(SAMPLES)), f"epoch {epoch}: {indices}"


def _final(directory):
    return read_checkpoint(list_checkpoints(directory)[-1])


def _assert_bit_identical(a, b):
    assert a["step"] == b["step"] == EPOCHS * STEPS_PER_EPOCH
    assert a["model"].keys() == b["model"].keys()
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert sa.keys() == sb.keys()
    for index in sa:
        for key in sa[index]:
            assert torch.equal(sa[index][key], sb[index][key]), (index, key)
    assert a["scheduler"] == b["scheduler"]
    for rank_a, rank_b in zip(a["rng"], b["rng"]):  # the very RNG streams, rank by rank
        assert torch.equal(rank_a["torch"], rank_b["torch"])


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    directory = tmp_path_factory.mktemp("uninterrupted")
    code, out = _run(directory)
    assert code == 0, out
    _assert_each_sample_once_per_epoch(directory, 2)
    return directory


def test_sigkill_mid_epoch_then_restart_resumes_bit_identically(tmp_path, reference):
    seed = random.SystemRandom().randrange(2**32)
    # a step inside an epoch that is not a checkpoint step (every 5th), so work is lost
    candidates = [s for s in range(2, EPOCHS * STEPS_PER_EPOCH) if s % 5 and s % STEPS_PER_EPOCH]
    kill_at = random.Random(seed).choice(candidates)
    why = f"killed rank 1 after step {kill_at} (seed {seed})"

    code, out = _run(tmp_path, "--kill-at-step", kill_at, max_restarts=1)

    assert code == 0, f"{why}\n{out}"
    assert "signal SIGKILL; restarting every worker" in out, why
    for rank in range(2):
        (start, first), (resumed, second) = _segments(tmp_path, rank)
        assert (start, resumed) == (0, kill_at // 5 * 5), why
        assert max(step for _, step, _ in first) >= kill_at > resumed, why
        assert second[0][1] == resumed + 1, why
        assert _effective(tmp_path, rank) == _effective(reference, rank), why
    _assert_each_sample_once_per_epoch(tmp_path, 2)
    _assert_bit_identical(_final(tmp_path), _final(reference))


def _wait_for_step(directory, step, proc, timeout=120.0):
    log = Path(directory) / "samples.rank0.log"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"run ended early: {proc.communicate()[0]}")
        if log.exists() and any(line.split()[3] == str(step)
                                for line in log.read_text().splitlines() if line[0] == "S"):
            return
        time.sleep(0.02)
    raise AssertionError(f"step {step} never came")


def test_sigterm_to_launcher_checkpoints_once_exits_preempted_and_resumes(tmp_path, reference):
    # no periodic checkpoints: the only one is the preemption's; 0.25 s per step leaves time
    proc = _start(tmp_path, "--save-every", 1000, "--step-delay", 0.25)
    _wait_for_step(tmp_path, 3, proc)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)

    assert proc.returncode == PREEMPTED_EXIT_CODE, out
    [path] = list_checkpoints(tmp_path)
    saved = read_checkpoint(path)
    stopped = saved["step"]
    assert out.count(f"preempted at step {stopped}") == 2, out  # both ranks, the same step
    assert 3 <= stopped < STEPS_PER_EPOCH, out  # mid-epoch
    assert saved["sampler"]["position"] == stopped * 8 and saved["epoch"] == 0

    code, out = _run(tmp_path)  # the same command again resumes

    assert code == 0, out
    for rank in range(2):
        assert [resumed for resumed, _ in _segments(tmp_path, rank)] == [0, stopped]
        assert _effective(tmp_path, rank) == _effective(reference, rank)
    _assert_each_sample_once_per_epoch(tmp_path, 2)
    _assert_bit_identical(_final(tmp_path), _final(reference))


def test_preempted_on_two_ranks_resumed_on_three_continues_the_global_order(tmp_path):
    # rank 0 alone gets SIGUSR1 after step 3: both ranks stop there (24 samples done)
    code, out = _run(tmp_path, "--save-every", 1000, "--preempt-at-step", 3)
    assert code == PREEMPTED_EXIT_CODE, out
    assert out.count("preempted at step 3") == 2, out

    code, out = _run(tmp_path, "--save-every", 1000, nproc=3)

    assert code == 0, out
    orders = [torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(11 + e)).tolist()
              for e in range(EPOCHS)]
    done = 3 * 2 * 4  # steps x ranks x batch
    for rank in range(2):
        assert [i for _, _, i in _segments(tmp_path, rank)[0][1]] == orders[0][rank:done:2]
    for rank in range(3):
        segments = _segments(tmp_path, rank)
        rest = segments[-1][1]
        assert segments[-1][0] == 3
        assert [i for e, _, i in rest if e == 0] == orders[0][done + rank :: 3]
        assert [i for e, _, i in rest if e == 1] == orders[1][rank::3]
    _assert_each_sample_once_per_epoch(tmp_path, 3)
