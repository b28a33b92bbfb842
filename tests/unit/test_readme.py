"""The README is a newcomer's page: it opens with the two commands CI and users run, stays
short, and links to every page of docs/ (tests/unit/test_docs.py checks the pages themselves)."""

from pathlib import Path

from tests.docs_pages import DOCS, README, links

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 250  # issue 25: a page a newcomer reads to the end; the rest lives in docs/


def _commands():
    text = README.read_text()
    block = text.split("```bash", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line and not line.startswith("#")]


def test_readme_opens_with_two_commands():
    main_job, tests = _commands()
    assert "pip install" in main_job and "torch==2.13.0" in main_job
    assert "phalanx run --nproc-per-node 2 examples/train_digits.py" in main_job
    assert "pip install" in tests and "pytest" in tests


def test_ci_runs_the_readme_test_command():
    _, tests = _commands()
    assert tests in (ROOT / ".ci" / "run").read_text().splitlines()


def test_readme_is_short():
    lines = len(README.read_text().splitlines())
    assert lines < MAX_LINES, f"README.md has {lines} lines; move detail to a page under docs/"


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(README.parent / t.partition("#")[0]).resolve() for t in links(README)}
    unlinked = [p.name for p in sorted(DOCS.glob("*.md")) if p.resolve() not in linked]
    assert not unlinked, f"docs pages the README does not link to: {unlinked}"
