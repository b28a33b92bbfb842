"""``phalanx checkpoint info|verify|export`` on checkpoints of both formats made in this process
(and one torch's dcp.save wrote): what is printed, exit statuses, damage named, exports equal
to the model's state dict bit for bit."""

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from phalanx.checkpoint import Checkpointer
from phalanx.cli import main


def _model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16),
                                torch.nn.Linear(16, 4, dtype=torch.float64))  # two dtypes
    optimizer = torch.optim.AdamW(model.parameters())
    model[2](model[:2](torch.randn(4, 8)).double()).sum().backward()
    optimizer.step()
    return model, optimizer


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{"consolidated": run dir, "sharded": run dir, "torch": a dcp.save dir, "model": state}."""
    root = tmp_path_factory.mktemp("runs")
    model, optimizer = _model()
    Checkpointer(root / "consolidated", model, optimizer).save(1, 2)
    Checkpointer(root / "sharded", model, optimizer, format="sharded").save(1, 3)
    dcp.save({"model": model.state_dict()}, checkpoint_id=root / "torch", no_dist=True)
    return {"consolidated": root / "consolidated", "sharded": root / "sharded",
            "torch": root / "torch", "model": model.state_dict()}


def _run(capsys, *argv):
    code = main(["checkpoint", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def test_info_of_both_formats_and_of_torchs(runs, capsys):
    for name, step, layout in (("consolidated", 2, "consolidated"), ("sharded", 3, "sharded (torch DCP)")):
        code, out, err = _run(capsys, "info", runs[name])  # a run directory: its newest
        assert code == 0, err
        assert f"ckpt-{step:012d}" in out and f"format      {layout}" in out
        assert f"step        {step}" in out and "epoch       1" in out and "world size  1" in out
        assert "layout      replicated" in out and "checksums   intact (every byte checked)" in out
        # 9 model tensors, and AdamW's step, exp_avg, exp_avg_sq of each of the 6 parameters
        assert "tensors     27, 3.9 kB (model 9" in out, out
        assert "  model.2.weight               float64   [4, 16]          512 B" in out, out
        assert "model.1.num_batches_tracked  int64     []" in out
    code, out, err = _run(capsys, "info", runs["torch"])
    assert code == 0, err
    assert "checksums   none: it has no checksums (phalanx-manifest.json missing" in out
    assert "world size  1" in out and "tensors     9," in out and "step" not in out


def test_verify_says_ok_and_names_each_damaged_file(runs, capsys, tmp_path):
    for name in ("consolidated", "sharded"):
        code, out, err = _run(capsys, "verify", runs[name])
        assert code == 0 and out.endswith("OK (3.9 kB of tensors, every byte checked)\n"), (out, err)
    code, out, err = _run(capsys, "verify", runs["torch"])
    assert code == 0 and out.endswith("structure OK, bytes unchecked\n")
    assert "note: it has no checksums" in err

    sharded = shutil.copytree(runs["sharded"], tmp_path / "sharded") / "ckpt-000000000003.dcp"
    for name in ("__0_0.distcp", "phalanx-state.ckpt"):
        with open(sharded / name, "r+b") as f:  # one byte flipped in each
            f.seek(100)
            byte = f.read(1)
            f.seek(100)
            f.write(bytes([byte[0] ^ 1]))
    code, out, err = _run(capsys, "verify", sharded)
    assert code == 1 and out == ""
    assert f"Checkpoint {sharded} is damaged: its file __0_0.distcp fails its checksum" in err
    assert f"Checkpoint {sharded} is damaged: its file phalanx-state.ckpt fails its checksum" in err
    assert err.endswith(f"{sharded}: DAMAGED\n")
    code, out, err = _run(capsys, "info", sharded)  # info: the same verdict, tensors still listed
    assert code == 1 and "checksums   DAMAGED (2 problems)" in out and "model.0.weight" in out
    (sharded / ".metadata").unlink()
    code, _, err = _run(capsys, "verify", sharded)
    assert code == 1 and "its file .metadata is missing" in err

    single = shutil.copytree(runs["consolidated"], tmp_path / "single") / "ckpt-000000000002.ckpt"
    with open(single, "r+b") as f:
        f.truncate(single.stat().st_size - 1)
    code, out, err = _run(capsys, "verify", single)
    assert code == 1 and f"Checkpoint {single} is truncated" in err


def test_export_to_torch_save_equals_the_models_state_dict(runs, capsys, tmp_path):
    for name in ("consolidated", "sharded", "torch"):
        out_file = tmp_path / f"{name}.pt"
        code, out, err = _run(capsys, "export", runs[name], out_file)
        assert code == 0, err
        assert out.startswith(f"{out_file}: the model of {runs[name]}")
        assert ("exported unchecked" in err) == (name == "torch")
        exported = torch.load(out_file, weights_only=True)
        assert list(exported) == list(runs["model"]), name
        for key, value in runs["model"].items():
            assert exported[key].dtype == value.dtype and torch.equal(exported[key], value), (name, key)
    code, _, err = _run(capsys, "export", runs["sharded"], tmp_path / "sharded.pt")
    assert code == 2 and "sharded.pt exists (--force replaces it)" in err
    assert _run(capsys, "export", runs["sharded"], tmp_path / "sharded.pt", "--force")[0] == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["consolidated.pt", "sharded.pt", "torch.pt"]


def test_export_refusals_and_bad_paths(runs, capsys, tmp_path):
    code, _, err = _run(capsys, "export", runs["sharded"], tmp_path / "model.bin")
    assert code == 2 and "Invalid output" in err and "expected a name ending in .pt, .pth, .safetensors, got '.bin'" in err
    try:
        import safetensors  # noqa: F401
    except ImportError:
        code, _, err = _run(capsys, "export", runs["sharded"], tmp_path / "model.safetensors")
        assert code == 2 and err.endswith("is not installed: pip install safetensors\n")
    else:
        code, _, err = _run(capsys, "export", runs["sharded"], tmp_path / "model.safetensors")
        assert code == 0, err
        from safetensors.torch import load_file
        loaded = load_file(tmp_path / "model.safetensors")
        assert all(torch.equal(loaded[k], v) for k, v in runs["model"].items())
    code, _, err = _run(capsys, "info", tmp_path / "missing")
    assert code == 2 and err == f"phalanx checkpoint: error: {tmp_path / 'missing'} does not exist\n"
    (tmp_path / "empty").mkdir()
    code, _, err = _run(capsys, "verify", tmp_path / "empty")
    assert code == 2 and "is neither a checkpoint" in err
    assert _run(capsys)[0] == 2  # no action: the manual, status 2
    code, out, _ = _run(capsys, "-h")
    assert code == 0 and "Exit status: 0 done; 1 the checkpoint is damaged" in out
    assert not list(tmp_path.glob("*.tmp-*")) and not list(tmp_path.glob(".*"))
