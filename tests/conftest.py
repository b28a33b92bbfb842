"""Test-session wiring for several pytest-xdist workers (``-n 2 --dist loadgroup``, as CI
runs the suite). Two kinds of tests must stay together on one worker (an ``xdist_group``):

* tests over network namespaces (marked ``netns``) create namespaces of fixed names and
  addresses (tests/e2e/launch_helpers.py), so they run one after the other;
* tests that share a module-scoped fixture: a multi-process test file starts its group of
  ranks once, in such a fixture, and its tests assert on the results. Split over the two
  workers, each worker started those ranks again (the compiled fully_shard checks ran four
  times instead of twice). One group per fixture and parameter value (world 2 and world 3
  may run on different workers); tests that share nothing stay single, so the workers
  still balance.

pytest-xdist (3.8) puts a test's group into its id by assigning ``item._nodeid``, which pytest
9.2 no longer reads (the id is ``item._id``, a structured NodeId): the groups were silently
ignored, ``loadgroup`` scheduled like ``load``. :func:`_join_group` sets the id either way.
"""

from __future__ import annotations

import pytest

_SHARED_SCOPES = ("module", "class", "package")


def _shared_setup_group(item: pytest.Item) -> str | None:
    """The group of the tests that share ``item``'s module- or class-scoped fixtures (with
    their parameters), or ``None`` when it uses none."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return None
    shared = sorted(name for name in info.names_closure
                    if (defs := info.name2fixturedefs.get(name)) and defs[-1].scope in _SHARED_SCOPES
                    and defs[-1].baseid)  # baseid "": a plugin's or pytest's own fixture
    if not shared:
        return None
    callspec = getattr(item, "callspec", None)
    values = getattr(callspec, "params", {})
    params = ",".join(f"{name}={_param_key(values[name], callspec.indices[name])}"
                      if name in values else name for name in shared)
    # no "]" in the name: xdist reads the text after the last "@" as the group only when no
    # "]" follows it
    module = item.nodeid.split("::")[0].removeprefix("tests/").removesuffix(".py")
    return f"{module}:{params}"


def _param_key(value: object, index: int) -> str:
    """A parameter as a group name has it: a number or a string by value, so that a test that
    picks the world-3 ranks by an indirect parametrisation of its own joins the other world-3
    tests; anything else by its index (the same in every worker: xdist checks that the workers
    collected the same ids)."""
    if isinstance(value, (bool, int, float, str)) or value is None:
        return repr(value).replace("]", ")").replace("[", "(").replace("@", "#")
    return f"#{index}"


def _join_group(item: pytest.Item, group: str) -> None:
    """Give ``item`` the id xdist's loadgroup scheduler reads its group from: ``id@group``."""
    grouped = f"{item.nodeid}@{group}"
    if hasattr(item, "_id"):  # pytest >= 9.2
        from _pytest.nodeid import NodeId

        item._id = NodeId.parse(grouped)
    else:
        item._nodeid = grouped
    if item.nodeid != grouped:  # loudly, not a silent `--dist load` again
        raise pytest.UsageError(f"cannot put {item.nodeid} in xdist group {group!r}: this "
                                "pytest keeps a test's id elsewhere (tests/conftest.py)")


@pytest.hookimpl(trylast=True)  # after xdist's own (a no-op under pytest 9.2, see above)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("netns") is not None:
            item.add_marker(pytest.mark.xdist_group("netns"))
        elif item.get_closest_marker("xdist_group") is None:
            group = _shared_setup_group(item)
            if group is not None:
                item.add_marker(pytest.mark.xdist_group(group))
    if getattr(config.option, "loadgroup", False):  # set on xdist's workers by --dist loadgroup
        for item in items:
            if "@" not in item.nodeid.rpartition("]")[2]:  # no group in its id yet
                marks = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                                for m in item.iter_markers("xdist_group")})
                if marks:
                    _join_group(item, "_".join(marks))
