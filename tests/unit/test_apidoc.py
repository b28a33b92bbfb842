"""docs/API.md is what tools/apidoc.py writes from the docstrings today, and names every
public name of phalanx."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import phalanx

ROOT = Path(__file__).resolve().parents[2]


def _apidoc():
    spec = importlib.util.spec_from_file_location("apidoc", ROOT / "tools" / "apidoc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_api_reference_is_regenerated_from_the_docstrings():
    text = _apidoc().render()
    assert (ROOT / "docs" / "API.md").read_text() == text, (
        "docs/API.md is out of date: run python tools/apidoc.py")
    for name in phalanx.__all__:
        assert f"`phalanx.{name}(" in text or f"module `phalanx.{name}`" in text, name
    section = text.split("module `phalanx.comm_hooks`", 1)[1].split("\n## ", 1)[0]
    for name in phalanx.comm_hooks.__all__:  # a subpackage's names are listed in its section
        assert f"`{name}" in section, name
    assert "### `phalanx.init_process_group(backend=None, init_method=None," in text
    assert "- `step(closure=None, **kwargs)`: Update this rank's parameters" in text
