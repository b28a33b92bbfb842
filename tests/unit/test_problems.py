"""The unused/late-gradient report: long lists folded, equal long lists said once, the fix."""

from __future__ import annotations

from phalanx.ddp.problems import problem_message


def test_a_long_list_is_folded_and_said_once_for_every_rank_that_has_it():
    names = [f"blocks.{i}.{w}" for i in range(12) for w in ("weight", "bias")]  # 24 parameters
    message = problem_message({0: {"missing": [], "late": names}, 1: {"missing": [], "late": names}},
                              static_graph=False)
    assert message == (
        "Gradients arrived for parameters after their bucket was settled (ranks 0, 1: "
        "'blocks.0.weight', 'blocks.0.bias', 'blocks.1.weight', 'blocks.1.bias', 'blocks.2.weight', "
        "'blocks.2.bias' and 18 more): they were not reachable from the forward's outputs, or got a "
        "gradient twice (e.g. reentrant checkpointing or a forward outside the DDP wrapper). With "
        "activation checkpointing, pass use_reentrant=False to torch.utils.checkpoint.checkpoint (or "
        "drop find_unused_parameters=True)")
    assert len(message) < 500


def test_short_lists_stay_per_rank():
    message = problem_message({0: {"missing": ["a"], "late": []}, 1: {"missing": ["a"], "late": []}},
                              static_graph=False)
    assert "(rank 0: 'a'; rank 1: 'a')" in message
