#!/usr/bin/env bash
# phalanx on the lent GPU machine: one command that runs every CUDA path once and benchmarks
# phalanx's DDP against torch's (tools/gpu_check.py says what, in which order, with which limits).
#
#   PYTHONPATH=src bash tools/gpu_check.sh "$OUT"              # the device tool's $OUT
#   bash tools/gpu_check.sh OUTDIR --parts shared_gpu          # a rerun of some parts
#
# Exit status: 0 all passed; 1 something failed, timed out or was not run; 2 refused (no CUDA,
# phalanx not importable from the checkout); 3 a CPU rehearsal (--rehearse-on-cpu).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUTDIR="${OUT:-}"
if [[ $# -gt 0 && "$1" != --* ]]; then
    OUTDIR="$1"
    shift
fi
if [[ -z "$OUTDIR" ]]; then
    echo "gpu_check: no output directory: give one (bash tools/gpu_check.sh DIR) or set OUT" >&2
    exit 2
fi
PYTHON="${PYTHON:-$(command -v python3 || command -v python)}"
if [[ -z "$PYTHON" ]]; then
    echo "gpu_check: REFUSED: no python3 or python on PATH (set PYTHON=...)" >&2
    exit 2
fi
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
cd "$ROOT" && exec "$PYTHON" "$ROOT/tools/gpu_check.py" --out "$OUTDIR" "$@"
