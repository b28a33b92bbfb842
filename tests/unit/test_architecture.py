"""Guard rails of the layout: which part of phalanx may import which, a torch-free launcher,
and a public API that is exactly the README's table."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import phalanx

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "phalanx"

# What each part of phalanx may import from phalanx (a part: a top-level module or package).
# Bottom to top; the launcher stack (launcher, cli) shares only env, errors, _logging and gate
# (the store's authenticating gate and doors, which both sides host) with the training stack. The package __init__ (lazy public names) may import anything.
ALLOWED = {
    "errors": set(),
    "env": {"errors"},
    "_logging": {"env"},
    "comm": set(),
    "gate": set(),
    "ledger": {"errors", "_logging", "comm"},
    "diagnostics": {"ledger", "env", "errors", "_logging", "comm"},
    "uneven": {"diagnostics", "ledger", "errors", "comm"},
    "metrics": {"diagnostics", "ledger"},
    # background work a group must finish before it is destroyed (an async checkpoint save)
    "unfinished": set(),
    "shm": {"errors"},  # the one transport phalanx owns (same-host shared memory), under c10d
    "process_group": {"env", "errors", "gate", "_logging", "diagnostics", "ledger", "shm",
                      "unfinished"},
    "agreement": {"comm", "errors", "diagnostics"},
    "sampler": {"process_group"},
    "streaming": {"process_group", "diagnostics", "ledger"},
    "batch": {"process_group", "_logging"},
    "sync_batchnorm": {"diagnostics", "ledger"},
    "hooks": set(),  # the hook writer's contract: no DDP, no phalanx (torch keeps them apart)
    # sync_batchnorm: the logging data's has_sync_bn counts phalanx's SyncBatchNorm as torch's
    "ddp": {"comm", "agreement", "errors", "_logging", "diagnostics", "ledger", "uneven", "hooks",
            "sync_batchnorm"},
    "zero": {"comm", "agreement", "errors", "diagnostics", "ledger", "uneven"},
    "fsdp": {"comm", "errors", "diagnostics", "ledger", "uneven"},
    # compression hooks and model averaging stand on the contract, not on the DDP that runs them
    "comm_hooks": {"hooks"},
    "model_averaging": {"comm", "diagnostics", "ledger", "hooks", "comm_hooks"},
    "checkpoint": {"comm", "agreement", "process_group", "errors", "_logging", "ddp",
                   "diagnostics", "ledger", "uneven", "unfinished"},
    "launcher": {"env", "errors", "_logging", "gate"},
    "bench": {"ddp", "fsdp", "comm_hooks", "process_group", "launcher", "gate", "diagnostics",
              "shm"},
    # env: torchrun's PET_ variables; checkpoint: imported by `phalanx checkpoint` when it runs
    "cli": {"launcher", "env", "errors", "bench", "checkpoint"},
    "__main__": {"cli"},
}
# Parts that must not import torch when imported (the launcher starts before its workers and
# must not pay torch's seconds of import first); imports inside functions are allowed.
TORCH_FREE = {"errors", "env", "_logging", "gate", "launcher", "cli", "__main__", "bench.report",
              "bench.ranks", "bench.options", "bench.netns", "bench.nodes", "bench"}


def _part(module: str) -> str:
    """``phalanx.ddp.reducer`` -> ``ddp``; ``phalanx.env`` -> ``env``."""
    return module.split(".")[1] if "." in module else "__init__"


def _imports(path: Path, module: str, top_level_only: bool) -> set[str]:
    """The absolute ``phalanx...``/``torch...`` modules ``path`` imports."""
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            found.add(target)
            found |= {f"{target}.{alias.name}" for alias in node.names}
    return found


def _modules(src: Path) -> dict[str, Path]:
    out = {}
    for path in sorted(src.rglob("*.py")):
        rel = path.relative_to(src.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def layering_violations(src: Path) -> list[str]:
    """Every import across parts that :data:`ALLOWED` does not allow, and every module-level
    torch import in a :data:`TORCH_FREE` part."""
    modules = _modules(src)
    problems = []
    for module, path in modules.items():
        part = _part(module)
        if part == "__init__":
            continue
        for target in _imports(path, module, top_level_only=False):
            if not target.startswith("phalanx.") or target not in modules:
                continue
            other = _part(target)
            if other not in (part, "__init__") and other not in ALLOWED.get(part, set()):
                problems.append(f"{module} imports {target}: {part} may import only "
                                f"{sorted(ALLOWED.get(part, set()))}")
        name = module.removeprefix("phalanx.")
        if name in TORCH_FREE or part in {"launcher", "cli", "__main__", "gate"}:
            torch = [t for t in _imports(path, module, top_level_only=True)
                     if t == "torch" or t.startswith("torch.")]
            if torch:
                problems.append(f"{module} imports {sorted(torch)[0]} at module level")
    return problems


def test_each_part_imports_only_the_layers_below_it():
    assert layering_violations(SRC) == []
    assert set(ALLOWED) == {_part(m) for m in _modules(SRC)} - {"__init__"}, "a new part needs its row"


def test_the_check_catches_a_launcher_that_imports_ddp(tmp_path):
    fake = tmp_path / "phalanx"
    for name, text in {
        "__init__.py": "",
        "errors.py": "",
        "ddp/__init__.py": "import torch\nfrom .wrapper import X\n",
        "ddp/wrapper.py": "X = 1\n",
        "launcher/__init__.py": "",
        "launcher/agent.py": "from ..ddp import X\nimport torch.distributed\n",
    }.items():
        (fake / name).parent.mkdir(parents=True, exist_ok=True)
        (fake / name).write_text(text)
    assert layering_violations(fake) == [
        "phalanx.launcher.agent imports phalanx.ddp: launcher may import only "
        "['_logging', 'env', 'errors', 'gate']",
        "phalanx.launcher.agent imports torch.distributed at module level",
    ]


def _readme_api_names() -> set[str]:
    """Names in the second column of the README's "The concepts and their API" table:
    ``phalanx.Name`` or ``name(``."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## The concepts and their API", 1)[1].split("\n## ", 1)[0]
    names = set()
    for line in section.splitlines():
        cells = line.split("|")
        if len(cells) > 3 and not set(cells[2].strip()) <= set("-"):
            names |= set(re.findall(r"`phalanx\.([A-Za-z_]\w*)", cells[2]))
            names |= set(re.findall(r"(?<![.\w])([a-z_]\w*)\(", cells[2]))
    return names


def test_public_names_are_the_readme_api_table():
    assert sorted(phalanx.__all__) == sorted(_readme_api_names())
    for name in phalanx.__all__:
        assert getattr(phalanx, name) is not None
