"""phalanx.unfinished: what a group is owed runs once, in order, every one even after an error."""

from phalanx import unfinished


class _Group:  # stands for a ProcessGroup: any object that can be weakly referenced
    pass


def test_finish_runs_each_owed_once_in_order_and_returns_the_first_error():
    group, other = _Group(), _Group()
    ran = []

    def fail():
        ran.append("fail")
        raise RuntimeError("first")

    unfinished.owe(group, lambda: ran.append("a"))
    unfinished.owe(group, fail)
    unfinished.owe(group, lambda: ran.append("b"))
    settled = lambda: ran.append("settled")  # noqa: E731
    unfinished.owe(other, settled)
    unfinished.settle(other, settled)
    error = unfinished.finish(group)
    assert ran == ["a", "fail", "b"] and str(error) == "first"
    assert unfinished.finish(group) is None and unfinished.finish() is None and ran == ["a", "fail", "b"]
