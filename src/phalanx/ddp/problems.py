"""The report of a backward whose gradients were missing or late, raised on every rank.

Each rank describes what it saw (``{"missing": names, "late": names}``: parameters that got
no gradient while that is not allowed, and gradients that came after their slot was
settled); the reducer gathers every rank's description and raises
:class:`~phalanx.errors.UnusedParametersError` with :func:`problem_message` of them.
"""

from __future__ import annotations


def problem_message(by_rank: dict[int, dict[str, list[str]]], static_graph: bool) -> str:
    """The error text for the ranks' ``{"missing": names, "late": names}`` reports."""
    parts = []
    missing = {r: d["missing"] for r, d in by_rank.items() if d["missing"]}
    if missing:
        where = "; ".join(f"rank {r}: {', '.join(map(repr, names))}" for r, names in missing.items())
        parts.append(
            "Parameters received no gradient in this backward pass while "
            f"find_unused_parameters=False ({where}). Pass find_unused_parameters=True to "
            "DistributedDataParallel, or make every parameter take part in the loss "
            "(or freeze it with requires_grad=False)"
        )
    late = {r: d["late"] for r, d in by_rank.items() if d["late"]}
    if late:
        where = "; ".join(f"rank {r}: {', '.join(map(repr, names))}" for r, names in late.items())
        cause = (
            "static_graph=True assumed them unused, as in the first iteration, but the graph changed"
            if static_graph
            else "they were not reachable from the forward's outputs, or got a gradient twice "
            "(e.g. reentrant checkpointing or a forward outside the DDP wrapper)"
        )
        parts.append(f"Gradients arrived for parameters after their bucket was settled ({where}): {cause}")
    return ". ".join(parts)
