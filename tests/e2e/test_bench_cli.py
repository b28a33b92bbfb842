"""`phalanx bench` end to end: launches the timing runs, prints the table, writes the chart."""

from __future__ import annotations

import json
import sys

import pytest

from phalanx import cli
from tests.e2e.launch_helpers import base_env, finish, start

HEADER = ("| model | implementation | processes | step ms (median) | phalanx/torch (median of "
          "paired step ratios; lower is better) | samples/s | scaling efficiency | exposed comm ms |")


@pytest.mark.slow  # timing runs of both implementations
def test_bench_prints_the_table_and_writes_the_chart(tmp_path):
    cmd = [sys.executable, "-m", "phalanx", "bench", "--model", "cnn", "--nproc-per-node", "2", "--steps", "2",
           "--repeats", "1", "--warmup", "1", "--batch-size", "4", "--out", str(tmp_path)]
    done = finish(start(cmd, env=base_env()), timeout=180)
    assert done.code == 0, done.err[-3000:]
    lines = done.out.splitlines()
    start_at = lines.index(HEADER)
    body = [line.split(" | ") for line in lines[start_at + 2: start_at + 6]]
    assert [(cells[1], cells[2]) for cells in body] == [
        ("single process", "1"), ("phalanx DDP", "1"), ("phalanx DDP", "2"), ("torch DDP", "2")]
    assert body[0][6] == "1.000" and float(body[2][4]) > 0  # the ratio is a number
    assert "Lower is better: below 1.000" in done.out
    # --steps 2 --repeats 1: the medians rest on 2 steps, and the report says so under the table
    assert "\nnote: only 2 timed steps per implementation (--steps 2 x --repeats 1)" in done.out
    png = (tmp_path / "bench.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert len(rows) == 4 and not list(tmp_path.glob("times-*.json"))


@pytest.mark.slow  # timing runs of three DDPs
def test_bench_shared_memory_times_phalanx_on_the_backend_torch_on_gloo_and_torch_on_it(tmp_path):
    cmd = [sys.executable, "-m", "phalanx", "bench", "--model", "deep-mlp", "--shared-memory",
           "--steps", "2", "--min-seconds", "0.3", "--repeats", "1", "--warmup", "2", "--batch-size", "4",
           "--no-plot", "--out", str(tmp_path)]
    done = finish(start(cmd, env=base_env()), timeout=180)
    assert done.code == 0, done.err[-3000:]
    assert "2 processes, phalanx on shared memory, torch on Gloo" in done.out
    lines = done.out.splitlines()
    start_at = lines.index(HEADER)
    body = [line.split(" | ") for line in lines[start_at + 2: start_at + 7]]
    assert [(cells[1], cells[2]) for cells in body] == [
        ("single process", "1"), ("phalanx DDP", "1"), ("phalanx DDP", "2"), ("torch DDP", "2"),
        ("torch DDP over phalanx_shm", "2")]
    assert float(body[2][4]) > 0 and body[3][4] == "-" and float(body[4][4]) > 0
    assert "torch DDP over phalanx_shm: its ratio is over torch DDP on Gloo." in done.out
    assert "deep-mlp: over the single process's " in done.out and " of torch's" in done.out
    assert "; under no_sync() (no gradient all-reduce) torch DDP's step adds " in done.out
    # --min-seconds 0.3: a deep-mlp step at batch 4 takes a few ms (under 0.15 s), so more than 2 are timed
    said = "timed steps per repeat (at least --steps 2, or --min-seconds 0.3 s): deep-mlp "
    steps = int(done.out.split(said)[1].split()[0])
    assert steps > 2 and len(json.loads((tmp_path / "bench.json").read_text())["rows"]) == 5


@pytest.mark.slow  # timing runs of both fully_shards
def test_bench_fully_shard_reports_step_time_and_bytes_against_torchs_fully_shard(tmp_path):
    cmd = [sys.executable, "-m", "phalanx", "bench", "--model", "gpt", "--fully-shard", "--steps", "3",
           "--repeats", "1", "--warmup", "1", "--batch-size", "2", "--no-plot", "--out", str(tmp_path)]
    done = finish(start(cmd, env=base_env()), timeout=180)
    assert done.code == 0, done.err[-3000:]
    assert "fully_shard (each block or layer a unit, then the root)" in done.out
    lines = done.out.splitlines()
    start_at = lines.index(HEADER + " sent/step (x param bytes) |")
    body = [line.split(" | ") for line in lines[start_at + 2: start_at + 6]]
    assert [(cells[1], cells[2]) for cells in body] == [
        ("single process", "1"), ("phalanx fully_shard", "1"), ("phalanx fully_shard", "2"),
        ("torch fully_shard", "2")]
    assert float(body[2][4]) > 0 and body[3][4] == "-"  # phalanx's paired with torch's
    assert all(cells[7] == "-" for cells in body)  # no no_sync(): exposed comm not measured
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    sent = {(r["implementation"], r["processes"]): r["sent/step (x param bytes)"] for r in rows}
    # the GPT's bytes a step at world 2 (docs/fully_shard.md): torch's about 2, phalanx's about
    # 1.5 (its reduce-scatter sends half of Gloo's); one process sends nothing
    assert sent[("single process", 1)] == sent[("phalanx fully_shard", 1)] == 0
    assert sent[("torch fully_shard", 2)] == pytest.approx(2.0, abs=0.1)
    assert sent[("phalanx fully_shard", 2)] == pytest.approx(1.5, abs=0.1)


def test_bench_refuses_bad_input(tmp_path):
    done = finish(start([sys.executable, "-m", "phalanx", "bench", "--nproc", "0", "--out",
                         str(tmp_path)], env=base_env()), timeout=60)  # the old spelling
    assert done.code == 2 and "--nproc-per-node" in done.err
    assert "expected an integer >= 1, got 0" in done.err
    done = finish(start([sys.executable, "-m", "phalanx", "bench", "--model", "resnet"],
                        env=base_env()), timeout=60)
    assert done.code == 2 and "invalid choice: 'resnet'" in done.err


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "argument --steps: expected an integer >= 1, got 0"),
    (["--repeats", "0"], "argument --repeats: expected an integer >= 1, got 0"),
    (["--batch-size", "0"], "argument --batch-size/--batch_size: expected an integer >= 1, got 0"),
    (["--warmup", "-1"], "argument --warmup: expected an integer >= 0, got -1"),
    (["--threads", "0"], "argument --threads: expected an integer >= 1, got 0"),
    (["--steps", "two"], "argument --steps: expected an integer >= 1, got 'two'"),
    (["--bucket-mb", "0"], "argument --bucket-mb/--bucket_mb: expected a number > 0, got 0"),
    (["--fully-shard", "--comm-hook", "fp16"], "--bucket-mb and --comm-hook are DDP's: a sharded model "
     "has neither buckets nor hooks (got --fully-shard with --bucket-mb None, --comm-hook fp16)"),
    (["--min-seconds", "0.5", "--warmup", "0"], "--min-seconds 0.5 estimates a step's time from "
     "the warm-up steps, and --warmup 0 takes none: give --warmup 1 or more"),
    (["--min-seconds", "0"], "argument --min-seconds/--min_seconds: expected a number > 0, got 0"),
    (["--fully-shard", "--shared-memory"], "--shared-memory compares the DDPs; --fully-shard runs "
     "both fully_shards on the default group, so they cannot be given together"),
])
def test_bench_refuses_bad_counts_before_starting_any_rank(capsys, tmp_path, argv, message):
    code = cli.main(["bench", *argv, "--out", str(tmp_path / "out")])  # in this process
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"phalanx bench: error: {message}\n"), err
    assert "usage:" not in err and not (tmp_path / "out").exists()  # nothing ran
