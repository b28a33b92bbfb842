"""Run every CUDA path of phalanx once on a one-GPU machine, and benchmark it against torch.

    PYTHONPATH=src bash tools/gpu_check.sh OUT            # all parts, about 5 minutes, at most 7.5
    bash tools/gpu_check.sh OUT --parts one_gpu bench_gloo2_eager    # some parts again

Each part is a subprocess with its own time limit (a hang costs that part, not the run), in
this order: ``preflight`` (versions, the GPU; refuses to go on without CUDA), ``one_gpu`` (NCCL
at world size 1, ``phalanx run --nproc-per-node gpu``, the device rule live and its unit tests,
the older one-GPU test), ``shared_gpu`` (two ranks on the GPU over
Gloo against torch), ``fsdp_offload`` (``fully_shard`` with ``CPUOffloadPolicy`` against
torch's), then the benchmark (benchmarks/bench_gpu.py), eager before compiled. A
part that would start with less than ``MIN_PART_S`` left of ``--budget`` is not run.

Writes ``OUT/gpu_check.json`` and ``OUT/gpu_check.txt`` (with each part's log under
``OUT/parts/``, the checks' numbers under ``OUT/results/``, the benchmark's under
``OUT/bench/``) and prints the text report last. Exit status: 0 every part passed; 1 a part
failed, timed out or was not run; 2 refused (no CUDA, phalanx not importable); 3 a CPU
rehearsal (``--rehearse-on-cpu``: the machinery checked without a GPU, proving nothing about CUDA).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The lent machine's command may run 10 minutes; the run must end well inside it, with its report.
DEFAULT_BUDGET_S = 450
# A part is not started with less time left than this: it could not finish, and would leave no report.
MIN_PART_S = 20
# Seconds a timed-out part gets between SIGTERM and SIGKILL.
KILL_GRACE_S = 5
RESULTS_VAR = "PHALANX_GPU_CHECK_RESULTS"  # tests/gpu/common.py writes the checks' numbers there
ON_CPU_VAR = "PHALANX_GPU_CHECKS_ON_CPU"  # tests/gpu/common.py: the checks' logic on the CPU

PYTEST = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider"]
BENCH = [sys.executable, str(ROOT / "benchmarks" / "bench_gpu.py")]
# name -> (time limit in seconds, command); the test parts' limits exceed their harness timeouts,
# so a hung rank is reported by the harness (with its stack) before the part is killed.
PARTS = {
    "one_gpu": (150, PYTEST + ["tests/gpu/test_one_gpu.py", "tests/dist/test_ddp_single_gpu.py",
                               "tests/unit/test_device_rule.py"]),
    "shared_gpu": (150, PYTEST + ["tests/gpu/test_shared_gpu.py"]),
    # fully_shard's CPU offload against torch's (its test's harness timeout: 90 s per case)
    "fsdp_offload": (120, PYTEST + ["tests/gpu/test_fsdp_offload.py"]),
    "bench_gloo2_eager": (90, BENCH + ["--setups", "gloo2", "--modes", "eager"]),
    "bench_nccl1_eager": (45, BENCH + ["--setups", "nccl1", "--modes", "eager"]),
    "bench_gloo2_compiled": (150, BENCH + ["--setups", "gloo2", "--modes", "compiled"]),
    "bench_nccl1_compiled": (75, BENCH + ["--setups", "nccl1", "--modes", "compiled"]),
}
PREFLIGHT_LIMIT_S = 45

PREFLIGHT = r"""
import importlib.util, json, platform, sys
info = {"python": sys.version.split()[0], "platform": platform.platform(),
        "missing": [m for m in ("torch", "numpy", "pytest") if importlib.util.find_spec(m) is None]}
if "torch" not in info["missing"]:
    import torch, torch.distributed as dist
    info.update(torch=torch.__version__, cuda_build=torch.version.cuda,
                cuda_available=torch.cuda.is_available(), gpus=torch.cuda.device_count(),
                nccl_available=dist.is_available() and dist.is_nccl_available())
    if info["cuda_available"]:
        info["gpu_names"] = [torch.cuda.get_device_name(i) for i in range(info["gpus"])]
        info["capability"] = list(torch.cuda.get_device_capability(0))
        info["memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
        if info["nccl_available"]:
            info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    try:
        import phalanx
        info["phalanx"] = phalanx.__file__
    except Exception as e:
        info["phalanx_error"] = repr(e)
print("PREFLIGHT " + json.dumps(info))
"""


def run_part(name: str, command: list[str], limit: float, log: Path, env: dict[str, str]) -> dict:
    """Run ``command`` in its own session, output to ``log``; kill its whole group at ``limit``."""
    began = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            code = proc.wait(timeout=limit)
            status = "passed" if code == 0 else "failed"
        except subprocess.TimeoutExpired:
            for signum in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(proc.pid, signum)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=KILL_GRACE_S)
                    break
                except subprocess.TimeoutExpired:
                    continue
            code, status = proc.returncode, "timeout"
    return {"name": name, "status": status, "exit_code": code, "seconds": round(time.monotonic() - began, 1),
            "limit_s": round(limit), "log": str(log.relative_to(log.parents[1]))}


def junit(path: Path, strict_skips: bool) -> dict:
    """Passed, failed and skipped tests of a pytest JUnit file; a skip fails the part when
    ``strict_skips`` (on the GPU machine nothing may skip: a skip there means CUDA went unseen)."""
    if not path.exists():
        return {"error": "pytest wrote no report (it did not start, or was killed)"}
    out: dict = {"passed": 0, "failed": [], "skipped": []}
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        test = f"{case.get('classname', '')}::{case.get('name', '')}"
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        skipped = case.find("skipped")
        if bad is not None:
            out["failed"].append({"test": test, "message": (bad.get("message") or "")[:2000],
                                  "text": (bad.text or "")[-4000:]})
        elif skipped is not None:
            out["skipped"].append({"test": test, "reason": skipped.get("message", "")})
        else:
            out["passed"] += 1
    out["skips_fail"] = strict_skips and bool(out["skipped"])
    return out


def preflight(out: Path, env: dict[str, str], rehearsal: bool) -> tuple[dict, str | None]:
    """The machine's facts, and why the run must stop (``None``: go on)."""
    log = out / "parts" / "preflight.log"
    part = run_part("preflight", [sys.executable, "-c", PREFLIGHT], PREFLIGHT_LIMIT_S, log, env)
    lines = [ln for ln in log.read_text().splitlines() if ln.startswith("PREFLIGHT ")]
    info = json.loads(lines[-1][len("PREFLIGHT "):]) if lines else {}
    info["part"] = part
    if shutil.which("nvidia-smi"):
        smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30)
        (out / "parts" / "nvidia-smi.txt").write_text(smi.stdout + smi.stderr)
    if "torch" in info.get("missing", ["torch"]):
        return info, f"torch cannot be imported by {sys.executable} (see {part['log']})"
    if "phalanx_error" in info or "phalanx" not in info:
        return info, (f"phalanx cannot be imported from the checkout ({info.get('phalanx_error')}); "
                      "run with PYTHONPATH=src from the repository root")
    if not info.get("cuda_available") or info.get("gpus", 0) < 1:
        why = (f"CUDA is not available (torch {info.get('torch')}, built for CUDA {info.get('cuda_build')}, "
               f"torch.cuda.is_available()={info.get('cuda_available')}, {info.get('gpus')} GPU(s)). "
               "This check runs phalanx's CUDA paths on a GPU machine; here every GPU test would "
               "skip, which proves nothing")
        return info, None if rehearsal else why
    return info, None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="where the reports go (created)")
    p.add_argument("--parts", nargs="+", choices=list(PARTS), default=list(PARTS),
                   help="the parts to run after the preflight (default: all, in order)")
    p.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S, help="seconds for the whole run")
    p.add_argument("--rehearse-on-cpu", action="store_true",
                   help="without CUDA: run the machinery anyway (the shared-GPU checks on the CPU, "
                        "the other GPU tests skip, the benchmark in --smoke mode) and exit 3; "
                        "proves nothing about CUDA")
    args = p.parse_args(argv)
    began, started = time.monotonic(), datetime.now(timezone.utc).isoformat(timespec="seconds")
    out = args.out.resolve()
    (out / "parts").mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, **{RESULTS_VAR: str(out / "results")})
    if args.rehearse_on_cpu:
        env[ON_CPU_VAR] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH")]))
    info, refusal = preflight(out, env, args.rehearse_on_cpu)
    report = {"started": started, "checkout": str(ROOT), "command": sys.argv, "budget_s": args.budget,
              "rehearsal_on_cpu": args.rehearse_on_cpu, "preflight": info, "parts": [], "refused": refusal}
    if refusal is None:
        run_parts(args, out, env, began, info, report)
    report["seconds"] = round(time.monotonic() - began, 1)
    status = 2 if refusal else 3 if args.rehearse_on_cpu else (
        0 if all(part["status"] == "passed" for part in report["parts"]) else 1)
    report["exit_status"] = status
    from gpu_check_report import write

    print(write(report, out))
    return status


def run_parts(args: argparse.Namespace, out: Path, env: dict[str, str], began: float, info: dict,
              report: dict) -> None:
    for name in args.parts:
        limit, command = PARTS[name]
        if name.startswith("bench"):
            command = command + ["--out", str(out / "bench")] + (["--smoke"] if args.rehearse_on_cpu else [])
        elif "pytest" in info.get("missing", []):
            report["parts"].append({"name": name, "status": "failed", "seconds": 0, "limit_s": limit,
                                    "error": f"pytest is not installed for {sys.executable}"})
            continue
        else:
            command = command + [f"--junitxml={out / 'parts' / (name + '.xml')}"]
        left = args.budget - (time.monotonic() - began)
        if left < MIN_PART_S:
            report["parts"].append({"name": name, "status": "not run", "seconds": 0, "limit_s": limit,
                                    "error": f"out of time: {left:.0f} s of the {args.budget:.0f} s budget left"})
            continue
        part = run_part(name, command, min(limit, left), out / "parts" / f"{name}.log", env)
        if not name.startswith("bench"):
            part["tests"] = junit(out / "parts" / f"{name}.xml", strict_skips=not args.rehearse_on_cpu)
            if part["status"] == "passed" and part["tests"].get("skips_fail"):
                part["status"] = "failed"  # nothing may skip on the GPU machine
        print(f"[gpu_check] {name}: {part['status']} in {part['seconds']:.0f} s (limit {part['limit_s']} s)",
              flush=True)
        report["parts"].append(part)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpu_check_report beside this file
    raise SystemExit(main())
