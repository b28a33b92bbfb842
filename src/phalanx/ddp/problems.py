"""The report of a backward whose gradients were missing or late, raised on every rank.

Each rank describes what it saw (``{"missing": names, "late": names}``: parameters that got
no gradient while that is not allowed, and gradients that came after their slot was
settled); the reducer gathers every rank's description and raises
:class:`~phalanx.errors.UnusedParametersError` with :func:`problem_message` of them. A long
list is folded to its first names and a count, and ranks with the same long list are named
together, so a model of hundreds of parameters gives a line a person can read.
"""

from __future__ import annotations

# Names shown per list before "and N more": enough to recognise the layer (a block's weight
# and bias, its norm's), short enough to keep the line readable when every rank has them.
SHOWN = 6


def _names(names: list[str]) -> str:
    shown = ", ".join(map(repr, names[:SHOWN]))
    return shown if len(names) <= SHOWN else f"{shown} and {len(names) - SHOWN} more"


def _where(by_rank: dict[int, list[str]]) -> str:
    """``rank 0: 'a', 'b'; rank 1: 'a'``; ranks whose long lists are equal named together."""
    groups: dict[tuple[str, ...], list[int]] = {}
    for rank, names in by_rank.items():
        key = tuple(names) if len(names) > SHOWN else (f"rank {rank}",) + tuple(names)
        groups.setdefault(key, []).append(rank)
    parts = []
    for ranks in groups.values():
        names = by_rank[ranks[0]]
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        parts.append(f"{who}: {_names(names)}")
    return "; ".join(parts)


def problem_message(by_rank: dict[int, dict[str, list[str]]], static_graph: bool) -> str:
    """The error text for the ranks' ``{"missing": names, "late": names}`` reports."""
    parts = []
    missing = {r: d["missing"] for r, d in by_rank.items() if d["missing"]}
    if missing:
        parts.append(
            "Parameters received no gradient in this backward pass while "
            f"find_unused_parameters=False ({_where(missing)}). Pass find_unused_parameters=True to "
            "DistributedDataParallel, or make every parameter take part in the loss "
            "(or freeze it with requires_grad=False)"
        )
    late = {r: d["late"] for r, d in by_rank.items() if d["late"]}
    if late:
        cause = (
            "static_graph=True assumed them unused, as in the first iteration, but the graph changed"
            if static_graph
            else "they were not reachable from the forward's outputs, or got a gradient twice "
            "(e.g. reentrant checkpointing or a forward outside the DDP wrapper). With activation "
            "checkpointing, pass use_reentrant=False to torch.utils.checkpoint.checkpoint (or drop "
            "find_unused_parameters=True)"
        )
        parts.append(f"Gradients arrived for parameters after their bucket was settled ({_where(late)}): {cause}")
    return ". ".join(parts)
