"""The launcher's root-cause line: each rank with its own exit status (issue 34 item 5), and
ranks named by their count ("rank 1", "ranks 1, 2"; issue 34 item 7)."""

from phalanx.errors import ranks_text
from phalanx.launcher.outcome import RoundEnd


def _failed(rank, code, culprits=()):
    return RoundEnd("failed", node=0, host="vm", rank=rank, local_rank=rank, returncode=code,
                    culprits=list(culprits))


def test_ranks_are_named_by_their_count():
    assert ranks_text([1]) == "rank 1" and ranks_text(range(1, 3)) == "ranks 1, 2"


def test_each_rank_named_by_a_hang_report_has_its_own_exit_status():
    # rank 1 ran out of batches and exited 0; rank 0 gave up waiting for it and exited 1: the
    # summary said rank 1 ended with exit code 1
    assert _failed(0, 1, [1]).cause({0: 1, 1: 0}) == (
        "rank 1 (exit code 0), named by the hang report (rank 0 (local rank 0) on node 0 (vm) "
        "stopped waiting for it: exit code 1)")
    assert _failed(1, 1, [1]).cause({0: -15, 1: 1}) == (
        "rank 1 (exit code 1), named by the hang report: rank 1 (local rank 1) on node 0 (vm)")
    assert _failed(0, 1, [1, 2]).cause({0: 1, 1: 0, 2: -9}) == (
        "ranks 1, 2 (rank 1: exit code 0; rank 2: signal SIGKILL), named by the hang report "
        "(rank 0 (local rank 0) on node 0 (vm) stopped waiting for them: exit code 1)")
    # a rank on another node: its status is not known here, and none is made up
    assert _failed(0, 1, [3]).cause({0: 1}) == (
        "rank 3, named by the hang report (rank 0 (local rank 0) on node 0 (vm) stopped "
        "waiting for it: exit code 1)")
    assert _failed(0, 1).cause() == "rank 0 (local rank 0) on node 0 (vm): exit code 1"
