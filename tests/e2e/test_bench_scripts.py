"""The side-by-side benchmark scripts of this session's work, smoke-tested with tiny settings:
each starts its ranks, measures every variant and writes its JSON (the figures themselves are
docs/benchmarks.md's, measured on an idle machine)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.e2e.launch_helpers import ROOT, base_env

pytestmark = pytest.mark.slow  # each starts two ranks and builds models


def _run(script: str, *argv: str, out) -> dict:
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *argv, "--json", str(out)],
                          env=base_env(), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def test_bench_fsdp_measures_both_fully_shards_and_ddp(tmp_path):
    rows = _run("bench_fsdp.py", "--depth", "1", "--steps", "4", "--warmup", "1", out=tmp_path / "f.json")["results"]
    assert rows["phalanx fully_shard"]["held_per_rank"] == pytest.approx(2.0, rel=0.02)  # 1/2 of 4x
    assert rows["torch DDP"]["held_per_rank"] == pytest.approx(4.0, rel=0.01)  # params, grads, 2 AdamW
    # each at its default: phalanx over shared memory (nothing through a socket), torch over
    # Gloo (its DDP's all-reduce writes about the parameters' bytes a step)
    assert rows["phalanx fully_shard"]["sent_per_step"] is None and rows["phalanx DDP"]["sent_per_step"] is None
    assert rows["torch DDP"]["sent_per_step"] == pytest.approx(1.0, abs=0.1)
    assert rows["torch fully_shard"]["sent_per_step"] > 1
    assert rows["phalanx / torch fully_shard step"]["median"] > 0


def test_bench_zero_puts_torchs_zero_on_gloo_and_phalanx_at_its_default(tmp_path):
    out = tmp_path / "z.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_zero.py"), "--width", "64",
                           "--rounds", "1", "--steps", "1", "--json", str(out)],
                          env=base_env(), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "world size 2, phalanx over shared memory, torch over Gloo, MLP" in done.stdout
    rows = json.loads(out.read_text())["results"]
    assert set(rows) == {"unsharded", "phalanx_zero", "torch_zero", "training"}
    # Adam's two states of 4 x (64 x 64 + 64) floats (and its step counts), split by either ZeRO
    whole = rows["unsharded"]["state_bytes_per_rank"]
    assert whole[0] == whole[1] == pytest.approx(2 * 4 * 4160 * 4, abs=64)
    for zero in ("phalanx_zero", "torch_zero"):
        held = rows[zero]["state_bytes_per_rank"]
        assert max(held) < whole[0] and sum(held) == pytest.approx(whole[0], abs=64), (zero, held)


def test_bench_compile_times_eager_and_compiled_ddps(tmp_path):
    rows = _run("bench_compile.py", "--depth", "1", "--backend", "eager", "--steps", "4", "--warmup", "1",
                "--gloo", out=tmp_path / "c.json")["results"]
    assert set(rows) == {"phalanx compiled / torch compiled", "phalanx compiled / phalanx eager",
                         "torch compiled / torch eager", "phalanx eager / torch eager"}
    assert all(r["q1"] <= r["median"] <= r["q3"] for r in rows.values())


def test_bench_tutorial_times_torch_and_phalanx_with_and_without_diagnostics(tmp_path):
    rows = _run("bench_tutorial.py", "--rounds", "1", "--epochs", "2", "--batch-size", "256",
                out=tmp_path / "t.json")["results"]
    assert set(rows) == {"torch", "phalanx", "phalanx-nodiag", "phalanx-gloo"}
    assert rows["torch"]["ratio"] == 1.0
    assert all(r["epoch_s"] > 0 and len(r["per_launch"]) == 1 for r in rows.values())


@pytest.mark.netns
@pytest.mark.skipif(not (os.geteuid() == 0 and shutil.which("ip") and shutil.which("tc")),
                    reason="network namespaces need root, ip and tc")
def test_bench_tutorial_runs_torch_and_phalanx_as_two_nodes_across_namespaces(tmp_path):
    def namespaces() -> set[str]:
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        return {line.split()[0] for line in listed.splitlines() if line.startswith("phxtut")}

    before = namespaces()  # an earlier run killed by hand may have left its own
    out = _run("bench_tutorial.py", "--netns", "--threads", "--rounds", "1", "--epochs", "2", "--batch-size", "256",
               out=tmp_path / "n.json")
    rows = out["results"]
    assert set(rows) == {"torch", "phalanx", "phalanx-nodiag"}  # no shared memory across hosts
    assert all(r["epoch_s"] > 0 and len(r["per_launch"]) == 1 for r in rows.values())
    # each rank's threads over the timed epoch, its launcher's too: phalanx's watchdog thread is
    # there with diagnostics on only
    threads = out["threads"]
    for impl in rows:
        for rank in ("0", "1"):
            named = threads[impl][rank]
            assert "MainThread" in named and any(n.startswith("launcher: ") for n in named), named
            assert all(len(figures) == 3 and min(figures) >= 0 for figures in named.values()), named
            assert ("phalanx-watchdog" in named) == (impl == "phalanx"), (impl, sorted(named))
    assert namespaces() <= before, namespaces() - before  # this run's namespaces went with it


def test_bench_data_times_streaming_and_plain_at_each_worker_count(tmp_path):
    rows = _run("bench_data.py", "--shards", "3", "--samples-per-shard", "50", "--seq-len", "8",
                "--repeats", "1", "--workers", "0", "2", out=tmp_path / "d.json")["results"]
    for workers in (0, 2):
        for name in ("plain", "phalanx", "phalanx unshuffled"):
            assert rows[f"{name}, workers {workers}"]["median"] > 0
        assert rows[f"phalanx / plain, workers {workers}"]["median"] > 0
        if sys.platform == "linux":  # CPU times from /proc, the workers' included
            assert all(rows[f"{name} CPU s an epoch, workers {workers}"]["median"] >= 0
                       for name in ("plain", "phalanx", "phalanx unshuffled"))
            assert f"phalanx / plain by CPU, workers {workers}" in rows


def test_bench_checkpoint_times_every_format_at_each_world_size(tmp_path):
    """--quick: the single-process table, then the fully sharded GPT at worlds 1 and 2: every
    save and load measured, the bytes each rank wrote exact (rank 0 its share of the sharded
    save, the whole consolidated file), the async stall and the peak memory recorded."""
    rows = _run("bench_checkpoint.py", "--quick", out=tmp_path / "k.json")["results"]
    assert rows["save: phalanx Checkpointer.save"]["ms_median"] > 0
    for world in (1, 2):
        saves = {name: rows[f"w{world} save: {name}"] for name in (
            "consolidated", "sharded", "sharded async", "dcp.save", "dcp.async_save", "disk write+fsync")}
        total = sum(saves["sharded"]["bytes_by_rank"])
        assert saves["consolidated"]["bytes_by_rank"][1:] == [0] * (world - 1)  # rank 0 writes it all
        state = sum(saves["sharded"]["shard_by_rank"])  # every rank's shards: the whole state
        assert saves["consolidated"]["bytes_by_rank"][0] >= state and total >= state
        # rank 0 writes its share plus the small files only it writes (.metadata, state, manifest)
        small = sum(saves["sharded"]["rank0_small_files"].values())
        assert saves["sharded"]["bytes_by_rank"][0] <= total / world + saves["sharded"]["unit"] + small
        assert saves["disk write+fsync"]["bytes_by_rank"] == saves["sharded"]["bytes_by_rank"]
        assert all(s["s_median"] > 0 and len(s["peak_rise_by_rank"]) == world for s in saves.values())
        for name in ("sharded async", "dcp.async_save"):
            stall = rows[f"w{world} stall: {name}"]
            parts = stall["returned_s"] + stall["step_s"] + stall["waited_s"]
            assert stall["stall_s"] == pytest.approx(parts, rel=0.5) and stall["step_gap_s"] > 0
        other = 2 if world == 1 else 1
        for name in ("consolidated", "sharded", "dcp.load"):
            assert rows[f"w{world} load from w{other}: {name}"]["s_median"] > 0
