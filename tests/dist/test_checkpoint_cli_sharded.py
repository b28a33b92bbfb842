"""``phalanx checkpoint export`` joins a fully_shard model's shards: saved at world 2 in both
formats, exported in this process (no process group), equal to the full tensors bit for bit."""

import pytest
import torch

from phalanx.checkpoint import Checkpointer
from phalanx.cli import main
from tests.dist.test_checkpoint_dcp import _build, _full
from tests.harness import run_ranks


def _save(rank, world_size, directory):
    model, opt = _build("fully_shard", 0)
    for fmt in ("consolidated", "sharded"):
        Checkpointer(directory / fmt, model, opt, format=fmt).save(0, 1)
    return {k: _full(v) for k, v in model.state_dict().items()}  # (a collective per tensor)


@pytest.mark.slow
def test_export_joins_the_shards_of_both_formats(tmp_path, capsys):
    full = run_ranks(_save, 2, tmp_path)[0]
    for fmt in ("consolidated", "sharded"):
        assert main(["checkpoint", "info", str(tmp_path / fmt)]) == 0
        out = capsys.readouterr().out
        assert "world size  2" in out and "layout      sharded" in out and "intact" in out, out
        assert main(["checkpoint", "export", str(tmp_path / fmt), str(tmp_path / f"{fmt}.pt")]) == 0
        exported = torch.load(tmp_path / f"{fmt}.pt", weights_only=True)
        assert {k: _full(v) for k, v in exported.items()} == full, fmt
