"""Test-session wiring for several pytest-xdist workers (``-n 2 --dist loadgroup``, as CI
runs the suite): tests over network namespaces (marked ``netns``) create namespaces of fixed
names and addresses (tests/e2e/launch_helpers.py), so they run one after the other, on one
worker."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("netns") is not None:
            item.add_marker(pytest.mark.xdist_group("netns"))
