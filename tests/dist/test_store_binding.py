"""Rank 0's store without a launcher (plain environment, srun): bound to MASTER_ADDR's
interface only, and behind the gate when PHALANX_JOB_SECRET is set."""

from __future__ import annotations

import os
from datetime import timedelta

import psutil
import pytest
import torch
import torch.distributed as dist

import phalanx
from tests.harness import run_ranks

SECRET = "dist-tests-job-secret-0123456789"
_WILDCARDS = ("0.0.0.0", "::")


def _listening() -> list[tuple[str, int]]:
    return [(c.laddr[0], c.laddr[1]) for c in psutil.Process().net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN]


def _train_and_look(rank, world_size, probe: bool = False):
    phalanx.init_process_group(backend="gloo")
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    plain = None
    if probe:  # a client without the secret, at rank 0's gate
        try:
            port = int(os.environ["MASTER_PORT"])
            dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=1)).set("evil", "1")
            plain = "wrote a key"
        except RuntimeError as e:
            plain = type(e).__name__
    phalanx.barrier()
    listening = _listening()
    phalanx.destroy_process_group()
    return t.item(), listening, plain, int(os.environ["MASTER_PORT"])


def test_rank_0s_store_listens_on_the_master_address_only():
    # torch's TCPStore binds every interface itself ('::'); phalanx hands it a bound socket
    results = run_ranks(_train_and_look, 2, init=False, env={"PHALANX_JOB_SECRET": None})
    for summed, listening, _, _ in results:
        assert summed == 3.0
        assert not [a for a, _ in listening if a in _WILDCARDS], listening
    _, listening, _, port = results[0]
    assert [a for a, p in listening if p == port] == ["127.0.0.1"], listening


def test_with_a_job_secret_the_store_is_gated():
    results = run_ranks(_train_and_look, 2, init=False, env={"PHALANX_JOB_SECRET": SECRET},
                        probe=True)
    for summed, listening, plain, _ in results:
        assert summed == 3.0
        assert not [a for a, _ in listening if a in _WILDCARDS], listening
        assert plain in ("DistNetworkError", "DistStoreError"), plain  # it wrote nothing
    _, listening, _, port = results[0]
    assert [a for a, p in listening if p == port] == ["127.0.0.1"], listening  # the gate


def _expect_error(rank, world_size):
    try:
        phalanx.init_process_group(backend="gloo", timeout=timedelta(seconds=3))
    except Exception as e:
        return type(e).__name__, str(e)
    return None


@pytest.mark.slow  # rank 0 waits out its rendezvous timeout
def test_a_rank_with_another_secret_is_refused():
    results = run_ranks(_expect_error, 2, init=False, env=lambda r: {
        "PHALANX_JOB_SECRET": SECRET if r == 0 else "another-secret-0123456789"})
    kind, message = results[1]
    assert kind == "EnvironmentConfigError", results
    assert "rank 0's store at 127.0.0.1:" in message and "refused this process's PHALANX_JOB_SECRET" in message
    assert results[0][0] == "RendezvousError"  # rank 1 never joined
