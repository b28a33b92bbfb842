"""What a wheel carries besides the code: the licence pyproject names, and py.typed."""

from __future__ import annotations

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="Python 3.11+ reads pyproject.toml itself")
ROOT = Path(__file__).resolve().parents[2]


def test_license_file_matches_pyproject_and_py_typed_ships():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert config["project"]["license"] == {"text": "BSD-3-Clause"}
    license_text = (ROOT / "LICENSE").read_text()
    assert license_text.startswith("BSD 3-Clause License\n")
    assert "Neither the name of the copyright holder nor the names of its" in license_text
    assert (ROOT / "src" / "phalanx" / "py.typed").is_file()
    # setuptools ships LICENSE by itself; package data must be named
    assert config["tool"]["setuptools"]["package-data"]["phalanx"] == ["py.typed"]
