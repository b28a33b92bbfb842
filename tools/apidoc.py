"""Write docs/API.md: every public name of ``phalanx`` with its signature and the first
paragraph of its docstring, in the order of the README's API table.

    python tools/apidoc.py            # regenerate docs/API.md
    python tools/apidoc.py --check    # exit 1 if docs/API.md is out of date

``tests/unit/test_apidoc.py`` runs the check, so a docstring or signature changed without
regenerating the page fails the suite.
"""

from __future__ import annotations

import argparse
import inspect
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "API.md"
_ROLE = re.compile(r":[a-z]+:`~?(?:[\w.]*\.)?([^`]+)`")  # :class:`~a.b.Name` -> `Name`


def _readme_table() -> list[tuple[str, list[str]]]:
    """``(concept, [name, ...])`` for each row of the README's API table, in order."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## The concepts and their API", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) > 3 and cells[1] not in ("concept", "") and not set(cells[2]) <= set("-"):
            names = re.findall(r"`phalanx\.([A-Za-z_]\w*)|(?<![.\w])([a-z_]\w*)\(", cells[2])
            rows.append((cells[1], list(dict.fromkeys(a or b for a, b in names))))
    return rows


def _signature(obj) -> str:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return "(...)"
    params = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()
              if p.name != "self"]
    return str(sig.replace(parameters=params, return_annotation=inspect.Signature.empty))


def _first_paragraph(obj) -> str:
    """The first paragraph of ``obj``'s own docstring (not one inherited from a torch base)."""
    doc = inspect.cleandoc(obj.__doc__) if getattr(obj, "__doc__", None) else ""
    paragraph = doc.split("\n\n", 1)[0].strip()
    return _ROLE.sub(r"`\1`", paragraph)


def _members(cls) -> list[str]:
    """The public methods and properties ``cls`` and its phalanx bases define (not its torch
    base's); an override without a docstring has its base's summary."""
    found: dict[str, tuple[object, str]] = {}
    for klass in reversed(cls.__mro__):
        if not klass.__module__.startswith("phalanx"):
            continue
        for name, member in vars(klass).items():
            if name.startswith("_") or not (callable(member) or isinstance(member, property)):
                continue
            summary = " ".join(_first_paragraph(member).split()) or found.get(name, (None, ""))[1]
            found[name] = (member, summary)
    lines = []
    for name, (member, summary) in found.items():
        if isinstance(member, property):
            head = f"`{name}` (property)"
        else:
            head = f"`{name}{_signature(getattr(cls, name))}`"
        lines.append(f"- {head}: {summary}" if summary else f"- {head}")
    return lines


def _module(name: str, module) -> list[str]:
    """A subpackage's section: its summary, then each name of its ``__all__``."""
    out = [f"### module `phalanx.{name}`", "", _first_paragraph(module), ""]
    for member in module.__all__:
        obj = getattr(module, member)
        if not callable(obj):
            out.append(f"- `{member} = {obj!r}`")
            continue
        kind = "class " if inspect.isclass(obj) else ""
        summary = " ".join(_first_paragraph(obj).split())
        out.append(f"- {kind}`{member}{_signature(obj)}`" + (f": {summary}" if summary else ""))
    return out + [""]


def render() -> str:
    import phalanx

    out = ["# phalanx API reference", "",
           "Generated from the docstrings by `python tools/apidoc.py`; do not edit by hand.",
           "Every public name of `phalanx`, in the order of the README's API table (the",
           "`phalanx run` and `phalanx bench` commands: `phalanx run -h`, `phalanx bench -h`).", ""]
    for concept, names in _readme_table():
        if not names:
            continue
        out += [f"## {concept}", ""]
        for name in names:
            obj = getattr(phalanx, name)
            if inspect.ismodule(obj):
                out += _module(name, obj)
                continue
            kind = "class " if inspect.isclass(obj) else ""
            out += [f"### {kind}`phalanx.{name}{_signature(obj)}`", "", _first_paragraph(obj), ""]
            if inspect.isclass(obj) and not issubclass(obj, BaseException):
                members = _members(obj)
                out += [*members, ""] if members else []
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/API.md is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is out of date: run python tools/apidoc.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
