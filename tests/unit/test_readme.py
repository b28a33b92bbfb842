"""The README's two commands are the ones CI and users run."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _commands():
    text = (ROOT / "README.md").read_text()
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
