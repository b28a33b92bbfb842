"""Manual pages for a terminal: a subcommand's parser whose description is its module's
docstring, with the reStructuredText markup taken out."""

from __future__ import annotations

import argparse
import re
from typing import Any

# :class:`~phalanx.x.Name`, :func:`name` ... -> Name / name (the last dotted part after "~")
_ROLE = re.compile(r":[a-z]+:`~?(?:[\w.]*\.)?([^`]+)`")


def plain(text: str) -> str:
    """``text`` without reST markup: ````code```` and ``**bold**`` lose their marks, roles
    such as ``:class:`X``` keep only the name, and a paragraph's closing ``::`` becomes ``:``.

    Example::

        >>> plain("**One node.** ``phalanx run x.py``, see :func:`~phalanx.launch`::")
        'One node. phalanx run x.py, see launch:'
    """
    text = _ROLE.sub(r"\1", text)
    text = re.sub(r"``(.+?)``", r"\1", text, flags=re.S)
    text = re.sub(r"\*\*(.+?)\*\*", r"\1", text, flags=re.S)
    text = re.sub(r"\s::$", "", text, flags=re.M)  # "text ::" introduces a block silently
    return re.sub(r"::$", ":", text, flags=re.M)


def add_manual_parser(commands: argparse._SubParsersAction, name: str, summary: str,
                      manual: str, **kwargs: Any) -> argparse.ArgumentParser:
    """A subcommand ``name`` whose ``-h`` shows ``manual`` (a docstring) as plain text;
    ``kwargs`` go to the parser's class."""
    return commands.add_parser(
        name, help=summary, description=plain(manual),
        formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False, **kwargs,
    )
