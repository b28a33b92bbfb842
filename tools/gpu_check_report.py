"""The reports of tools/gpu_check.py: ``gpu_check.json`` (everything) and ``gpu_check.txt``
(short, ending with the verdict), from the run's record, the checks' numbers
(``OUT/results/``) and the benchmark's results (``OUT/bench/``)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Lines of a failing test's message the text report shows (the JSON has it all).
MESSAGE_LINES = 6


def _bench_table(directory: Path) -> str:
    """benchmarks/bench_gpu.py's table of ``directory`` (it needs no torch)."""
    if not directory.is_dir():
        return "no benchmark results"
    sys.path.insert(0, str(ROOT / "src"))
    spec = importlib.util.spec_from_file_location("bench_gpu", ROOT / "benchmarks" / "bench_gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.report(directory)


def _machine(info: dict) -> str:
    gpu = ", ".join(info.get("gpu_names", [])) or "no GPU"
    extra = f" (sm {'.'.join(map(str, info['capability']))}, {info['memory_gib']} GiB)" if "capability" in info else ""
    return (f"machine: {gpu}{extra}; torch {info.get('torch')}, CUDA {info.get('cuda_build')}, "
            f"NCCL {info.get('nccl', 'n/a')}, python {info.get('python')}; missing: "
            f"{', '.join(info.get('missing', [])) or 'nothing'}")


def _part_lines(part: dict) -> list[str]:
    tests = part.get("tests", {})
    counts = ""
    if "passed" in tests:
        counts = f"  {tests['passed']} passed, {len(tests['failed'])} failed, {len(tests['skipped'])} skipped"
    lines = [f"  {part['name']:<22}{part['status']:<9}{part['seconds']:>6.0f} s / {part['limit_s']} s{counts}"]
    if part.get("error"):
        lines.append(f"      {part['error']}")
    if tests.get("error"):
        lines.append(f"      {tests['error']}")
    for failed in tests.get("failed", []):
        message = (failed["message"] or failed["text"]).strip().splitlines()[:MESSAGE_LINES]
        lines.append(f"      FAILED {failed['test']}")
        lines += [f"        {line[:200]}" for line in message]
    if tests.get("skips_fail"):
        lines += [f"      SKIPPED (not allowed here) {s['test']}: {s['reason']}" for s in tests["skipped"]]
    if part["status"] in ("failed", "timeout") and not tests.get("failed"):
        lines.append(f"      see {part.get('log', 'its log')}")
    return lines


def _world1_note(directory: Path) -> str | None:
    for path in sorted(directory.glob("nccl1-*.json")) if directory.is_dir() else []:
        result = json.loads(path.read_text())
        if result["phalanx_buckets"] == 0 and result["torch_reducer"]:
            return ("note: at world size 1 phalanx's DDP builds no reducer (ddp/runtime.py, Runtime) and "
                    "torch's runs its own: nccl1 measures torch's reducer against none")
    return None


def _check_facts(results: dict) -> list[str]:
    """What the checks reported besides pass or fail: which matches with torch were not bit for
    bit (rank 0), and what world size 1 on NCCL chose."""
    lines = []
    shared = results.get("shared_gpu")
    if shared:
        inexact = sorted({f"{name}: {key.removesuffix(' bitwise')}" for name, got in shared[0].items()
                          for key, value in got.get("info", {}).items() if key.endswith("bitwise") and not value})
        lines.append("two ranks on one GPU, within tolerance but not bit for bit (rank 0): "
                     + ("; ".join(inexact) or "none"))
        # distances reported, not asserted (mixed precision: torch's DDP against the reference)
        reported = [f"{name}: {key} {value:.3g}" for name, got in sorted(shared[0].items())
                    for key, value in got.get("info", {}).items()
                    if isinstance(value, float)]
        if reported:
            lines.append("reported, not asserted (rank 0): " + "; ".join(reported))
    for part in ("nccl_world1", "phalanx_run_gpu"):
        if part in results:
            info = results[part].get("info", {})
            lines.append(f"{part}: " + ", ".join(f"{k}={v}" for k, v in info.items()))
    return lines


def _verdict(report: dict) -> str:
    if report["refused"]:
        return f"RESULT: REFUSED: {report['refused']}"
    bad = [p["name"] for p in report["parts"] if p["status"] != "passed"]
    if report["rehearsal_on_cpu"]:
        return f"RESULT: CPU REHEARSAL ONLY (proves nothing about CUDA); parts not passed: {', '.join(bad) or 'none'}"
    return "RESULT: PASS" if not bad else f"RESULT: FAIL ({len(bad)} of {len(report['parts'])} parts: {', '.join(bad)})"


def write(report: dict, out: Path) -> str:
    """Write both reports into ``out``; return the text one."""
    results = out / "results"
    report["check_results"] = {p.stem: json.loads(p.read_text()) for p in sorted(results.glob("*.json"))} \
        if results.is_dir() else {}
    report["bench"] = {p.stem: json.loads(p.read_text()) for p in sorted((out / "bench").glob("*.json"))} \
        if (out / "bench").is_dir() else {}
    table = _bench_table(out / "bench")
    report["bench_table"] = table
    lines = [f"phalanx GPU check, {report['started']}: {report['seconds']:.0f} s of a {report['budget_s']:.0f} s budget",
             _machine(report["preflight"])]
    if report["rehearsal_on_cpu"]:
        lines.append("REHEARSAL ON THE CPU: the shared-GPU checks ran on the CPU, the other GPU tests skip, the "
                     "benchmark is --smoke; this proves nothing about CUDA")
    lines += ["", "parts (status, seconds / limit):"] + _part_lines(report["preflight"]["part"])
    for part in report["parts"]:
        lines += _part_lines(part)
    lines += _check_facts(report["check_results"])
    lines += ["", "benchmark: median step time, and the median of paired phalanx/torch ratios (below 1: phalanx faster)",
              table]
    note = _world1_note(out / "bench")
    if note:
        lines.append(note)
    lines += ["", f"details: {out / 'gpu_check.json'}; logs: {out / 'parts'}; check numbers: {results}",
              _verdict(report)]
    text = "\n".join(lines)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "gpu_check.txt").write_text(text + "\n")
    return text
