"""Which parameters can a forward's outputs send a gradient to: a walk of the autograd graph.

``find_unused_parameters=True`` walks it after every synchronising forward, so that parameters
the backward cannot reach are settled at its start instead of holding their buckets back.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in ``obj``: nested tuples, lists, dicts, namedtuples and dataclasses."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from iter_tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from iter_tensors(item)
    elif hasattr(obj, "__dataclass_fields__") and not isinstance(obj, type):
        for name in obj.__dataclass_fields__:
            yield from iter_tensors(getattr(obj, name))


def reachable_params(outputs: Any, index: dict[int, int]) -> set[int]:
    """Positions (per ``index``: ``id(param) -> position``) of the parameters the outputs' graph reaches."""
    found: set[int] = set()
    stack = []
    for t in iter_tensors(outputs):
        if t.grad_fn is not None:
            stack.append(t.grad_fn)
        elif id(t) in index:  # a parameter returned as it is
            found.add(index[id(t)])
    seen: set[Any] = set()  # the nodes themselves: holding them keeps their identity stable
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # AccumulateGrad nodes hold their leaf
        if variable is not None and id(variable) in index:
            found.add(index[id(variable)])
        stack.extend(nxt for nxt, _ in node.next_functions if nxt is not None)
    return found
