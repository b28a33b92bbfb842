"""Under ``phalanx run --nproc-per-node gpu`` on a one-GPU machine: join with backend=None
(NCCL, pinned by phalanx), run tests/gpu/world1.py's parity, write it as JSON to argv[1]."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the checkout, for tests.gpu

import phalanx  # noqa: E402
from tests.gpu.world1 import parity  # noqa: E402

phalanx.init_process_group()
try:
    result = parity()
    if phalanx.get_rank() == 0:
        Path(sys.argv[1]).write_text(json.dumps(result))
finally:
    phalanx.destroy_process_group()
