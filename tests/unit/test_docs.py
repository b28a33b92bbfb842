"""README.md and docs/*.md as a user meets them: every Python example runs as written
(tests/docs_examples.py, at world size 1), every shell example is valid bash and its
`phalanx` command lines are accepted by phalanx's own parser, every relative link and anchor
resolves, every repository path the pages name exists, and the source map in
docs/development.md lists what src/phalanx holds."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys

import pytest
import torch

from phalanx.cli.command import build_parser
from phalanx.cli.run import config_from_args
from tests.docs_pages import DOCS, ROOT, blocks, links, pages, anchors, prose

LANGUAGES = {"python", "bash", "text"}  # text: output samples and the source map
# A path in the repository, as pages name them in code (`tests/dist/test_compile.py`,
# `phalanx/ledger/`); the package's own paths are under src/.
_REPO_PATH = re.compile(r"^(?:src|tests|tools|benchmarks|examples|docs|\.ci|phalanx)/[\w./-]*$")
_CODE_SPAN = re.compile(r"`([^`\n]+)`")


def _all_blocks():
    return [b for page in pages() for b in blocks(page)]


def test_every_code_block_names_its_language():
    unnamed = [b.name for b in _all_blocks() if b.language not in LANGUAGES]
    assert not unnamed, f"fenced blocks without one of {sorted(LANGUAGES)}: {unnamed}"


def test_every_python_example_runs():
    expected = [b.name for b in _all_blocks() if b.language == "python"]
    assert len(expected) >= 10  # the README's import table and the pages' examples
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    done = subprocess.run([sys.executable, "-m", "tests.docs_examples"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    reports = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [r["name"] for r in reports] == expected, done.stderr[-3000:]
    failed = {r["name"]: r["error"] for r in reports if r["error"]}
    assert not failed, "\n".join(f"{name}:\n{error}" for name, error in failed.items())


@pytest.mark.parametrize("block", [b for b in _all_blocks() if b.language == "bash"],
                         ids=lambda b: b.name)
def test_shell_examples_are_valid_bash(block):
    checked = subprocess.run(["bash", "-n"], input=block.code, capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr


def _phalanx_commands() -> list[tuple[str, list[str]]]:
    """Each `phalanx ...` command of the shell examples: (block, its arguments)."""
    found = []
    for block in (b for b in _all_blocks() if b.language == "bash"):
        for line in block.code.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            segment: list[str] = []
            for word in [*words, "&&"]:
                if word in ("&&", "||", ";", "|"):
                    if segment and segment[0].rsplit("/", 1)[-1] == "phalanx":
                        found.append((block.name, segment[1:]))
                    segment = []
                else:
                    segment.append(word)
    return found


def test_phalanx_command_lines_are_accepted(tmp_path, monkeypatch, capsys):
    commands = _phalanx_commands()
    assert len(commands) >= 6  # the README's first command and the launching page's
    monkeypatch.setenv("PHALANX_JOB_SECRET", "0123456789abcdef" * 2)  # several nodes need one
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")  # the scripts the examples start
    (tmp_path / "examples").mkdir()
    for script in (ROOT / "examples").glob("*.py"):
        (tmp_path / "examples" / script.name).write_text("")
    for name, argv in commands:
        try:
            args = build_parser().parse_args(argv)
        except SystemExit:
            pytest.fail(f"{name}: phalanx {shlex.join(argv)}: {capsys.readouterr().err}")
        if argv[0] == "run" and ("gpu" not in argv or torch.cuda.is_available()):
            config_from_args(args)  # raises LaunchConfigError for a refused combination


def _named_paths(page) -> set[str]:
    spans = _CODE_SPAN.findall(prose(page))
    words = [w for b in blocks(page) if b.language == "bash" for w in b.code.split()]
    return {w for w in [*spans, *words] if _REPO_PATH.match(w)}


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.name)
def test_paths_named_exist(page):
    missing = [p for p in sorted(_named_paths(page))
               if not (ROOT / ("src/" + p if p.startswith("phalanx/") else p)).exists()]
    assert not missing, f"{page.name} names paths that do not exist: {missing}"


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.name)
def test_relative_links_resolve(page):
    broken = []
    for target in links(page):
        if re.match(r"^[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.is_relative_to(ROOT) or not file.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target} (no heading #{anchor} in {file.name})")
    assert not broken, f"{page.name}: {broken}"


def test_source_map_lists_the_package():
    """docs/development.md's map of src/phalanx: every entry exists, every module and
    subpackage has an entry."""
    source_map = next(b.code for b in blocks(DOCS / "development.md") if b.code.startswith("src/phalanx/"))
    entries = set(re.findall(r"^  (\S+)", source_map, re.M))
    package = ROOT / "src" / "phalanx"
    present = {p.name + ("/" if p.is_dir() else "") for p in package.iterdir()
               if p.name != "__pycache__" and (p.is_dir() or p.suffix == ".py")}
    assert entries - present == set(), "the map names what src/phalanx lacks"
    assert present - entries == set(), "src/phalanx holds what the map does not name"
    for top in re.findall(r"^(\S+/)", source_map, re.M):
        assert (ROOT / top).is_dir(), top
