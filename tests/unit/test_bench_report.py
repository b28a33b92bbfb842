"""The benchmark table's arithmetic, on hand-made step times."""

from phalanx.bench.report import (
    COLUMNS,
    LEGEND,
    RATIO,
    SENT,
    STEP,
    busy_warning,
    caveats,
    ddp_rows,
    format_table,
    overheads,
    paired_ratio,
    steps_per_repeat,
)


def _times(sync, no_sync=()):
    return {"sync": list(sync), "no_sync": list(no_sync)}


def test_rows_scaling_exposed_comm_and_ratio():
    single = {"world_size": 1, "batch_size": 10,
              "times": {"mlp": {"bare": _times([0.10, 0.10, 0.12]), "phalanx": _times([0.105] * 3)}}}
    multi = {"world_size": 2, "batch_size": 10,
             "times": {"mlp": {"phalanx": _times([0.2, 0.125, 0.125], [0.1] * 3),
                               "torch": _times([0.2, 0.1, 0.125], [0.1] * 3)}}}
    rows = ddp_rows(single, multi)
    assert [tuple(r) for r in rows] == [COLUMNS] * 4
    bare, alone, phx, tch = rows
    assert (bare["implementation"], bare["processes"], bare[STEP]) == ("single process", 1, 100.0)
    assert bare["samples/s"] == 100.0 and bare["scaling efficiency"] == 1.0
    assert abs(alone["scaling efficiency"] - 100 / 105) < 1e-12  # the wrapper's overhead alone
    assert (phx["processes"], phx[STEP], phx["samples/s"]) == (2, 125.0, 160.0)
    assert phx["scaling efficiency"] == 0.8 and abs(phx["exposed comm ms"] - 25.0) < 1e-9
    assert phx[RATIO] == 1.0  # median of 1.0, 1.25, 1.0 (the medians' ratio would be 1.0 too)
    assert tch[RATIO] is None and alone["exposed comm ms"] is None
    # the ratio is defined beside the step times, and which way is better is said
    assert COLUMNS.index(RATIO) == COLUMNS.index(STEP) + 1 and "lower is better" in RATIO
    assert "not the ratio of the two median step times. Lower is better" in " ".join(LEGEND.split())


def test_fully_shard_rows_pair_the_two_fully_shards_and_add_the_bytes_sent():
    def t(sync, sent):
        return {"sync": list(sync), "no_sync": [], "sent": list(sent)}

    single = {"world_size": 1, "batch_size": 4,
              "times": {"gpt": {"bare": t([0.1] * 3, [0] * 3), "phalanx-fsdp": t([0.2] * 3, [0] * 3)}}}
    multi = {"world_size": 2, "batch_size": 4, "param_bytes": {"gpt": 1000},
             "times": {"gpt": {"phalanx-fsdp": t([0.3, 0.3, 0.4], [1490, 1500, 1480]),
                               "torch-fsdp": t([0.4, 0.3, 0.5], [2000, 1990, 2010])}}}
    rows = ddp_rows(single, multi, sent=True)
    assert [tuple(r) for r in rows] == [(*COLUMNS, SENT)] * 4
    assert [(r["implementation"], r["processes"]) for r in rows] == [
        ("single process", 1), ("phalanx fully_shard", 1), ("phalanx fully_shard", 2), ("torch fully_shard", 2)]
    assert rows[2][RATIO] == 0.8 and rows[1][RATIO] is None and rows[3][RATIO] is None  # median of .75, 1, .8
    assert [r[SENT] for r in rows] == [0.0, 0.0, 1.49, 2.0]
    assert all(r["exposed comm ms"] is None for r in rows)  # no no_sync() runs
    assert SENT not in ddp_rows(single, multi)[0]  # the DDP table keeps its columns


def test_busy_machine_is_warned_about():
    assert busy_warning(1.9, 2) is None and busy_warning(2.0, 2) is None
    assert busy_warning(3.25, 2).startswith(
        "the machine was busy: its load average reached 3.2 on 2 usable core(s) during the run")


def test_paired_ratio_cancels_drift():
    assert paired_ratio([1, 2, 4], [1, 2, 4]) == 1.0
    assert paired_ratio([1.1, 2.2, 40], [1, 2, 4]) == 1.1


def test_table_formats_ratios_and_missing_values():
    table = format_table([{"model": "cnn", STEP: 12.345, RATIO: 0.98765, "exposed comm ms": None}])
    assert table.splitlines() == [f"| model | {STEP} | {RATIO} | exposed comm ms |",
                                  "|---|---|---|---|", "| cnn | 12.3 | 0.988 | - |"]


def test_caveats_for_unwarmed_or_few_steps_and_negative_exposed_comm():
    rows = [{"implementation": "phalanx DDP", "processes": 2, "exposed comm ms": -1.25},
            {"implementation": "torch DDP", "processes": 2, "exposed comm ms": 3.0},
            {"implementation": "single process", "processes": 1, "exposed comm ms": None}]
    assert caveats(rows[1:], steps=10, repeats=3, warmup=3) == []  # nothing to say
    warmup, few, negative = caveats(rows, steps=1, repeats=1, warmup=0)
    assert warmup.startswith("--warmup 0: the first timed step of each repeat paid one-time "
                             "costs") and "scaling efficiency" in warmup
    assert few.startswith("only 1 timed step per implementation (--steps 1 x --repeats 1)")
    assert negative.startswith("exposed comm ms below 0 for phalanx DDP on 2 (-1.2): the steps "
                               "with gradient sync were faster") and negative.endswith("read it as 0")
    assert caveats([], steps=1, repeats=3, warmup=1) == []  # 3 timed steps: a median to trust
    assert caveats([], steps=2, repeats=1, warmup=1)[0].startswith("only 2 timed steps")


def test_shared_memory_rows_pair_torch_over_the_backend_with_torch_and_say_the_overheads():
    single = {"world_size": 1, "batch_size": 8,
              "times": {"cnn": {"bare": _times([0.100] * 3), "phalanx": _times([0.101] * 3)}}}
    multi = {"world_size": 2, "batch_size": 8,
             "times": {"cnn": {"phalanx": _times([0.110, 0.104, 0.108], [0.1] * 3),
                               "torch": _times([0.120, 0.120, 0.116], [0.104] * 3),
                               "torch-shm": _times([0.114, 0.108, 0.116], [0.1] * 3)}}}
    rows = ddp_rows(single, multi)
    names = [(r["implementation"], r["processes"]) for r in rows]
    assert names[-1] == ("torch DDP over phalanx_shm", 2)
    assert abs(rows[-1][RATIO] - 0.95) < 1e-12  # median of .95, .9, 1.0: over torch's DDP on Gloo
    assert abs(rows[2][RATIO] - 0.9166666666666666) < 1e-12  # phalanx over torch, as before
    assert overheads(rows) == [
        "cnn: over the single process's 100.0 ms, phalanx DDP +8.0 ms, torch DDP +20.0 ms, "
        "torch DDP over phalanx_shm +14.0 ms; phalanx's is 0.40 of torch's; under no_sync() (no gradient "
        "all-reduce) torch DDP's step adds +4.0 ms already, the floor under any DDP's addition here"]
    assert overheads(rows[:2]) == []  # no DDP at 2 processes: nothing to say


def test_steps_per_repeat_and_the_steps_min_seconds_asks_for():
    from phalanx.bench.engine import steps_for

    assert steps_for(10, 0.5, 0.015) == 34  # deep-mlp's 15 ms steps: half a second of them
    assert steps_for(10, 0.5, 0.08) == 10  # 10 steps take longer already
    assert steps_for(3, 1.0, 0.0) == 3  # no estimate: --steps as given
    result = {"times": {"gpt": {"phalanx": _times([0.2] * 20)}, "deep-mlp": {"phalanx": _times([0.01] * 170)}}}
    assert steps_per_repeat(result, 5) == {"gpt": 4, "deep-mlp": 34}
