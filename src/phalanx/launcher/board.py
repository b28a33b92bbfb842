"""The nodes' board: the verbs the agent uses to meet the other nodes round after round.

:class:`NodeBoard` is a follower of several nodes, :class:`LeaderBoard` node 0, which
decides; the protocol and its keys are in :mod:`phalanx.launcher.membership`. One node alone
has :class:`phalanx.launcher.localboard.LocalBoard`.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, replace
from typing import Callable

from ..errors import RendezvousError
from .config import LaunchConfig
from .membership import (
    ACK_WAIT_S,
    EXITED,
    GONE_COUNT,
    POLL_S,
    Layout,
    MajorityLost,
    Node,
    Store,
    StoreLost,
    _key,
    checked_out_key,
    gone_key,
    layout_for,
    majority,
)
from .outcome import RoundEnd

Interrupted = Callable[[], None]  # raises when a stop signal has arrived
# How long node 0, refusing a launcher started with other options, waits for it to read why.
REFUSAL_READ_S = 5.0


class NodeBoard:
    """A node that is not node 0: registers, then takes the place node 0 gives it."""

    multi = True

    def __init__(self, store: Store, me: Node, config: LaunchConfig, interrupted: Interrupted,
                 workers_port: int, note: Callable[[str], None]) -> None:
        self._s, self.me, self._config = store, me, config
        self._raise_if, self._note = interrupted, note
        self._workers_port = workers_port
        self._timeout = config.rdzv_timeout
        self.members: list[Node] = []
        self.run_id = ""
        self._checked_out = self._refused = False
        # node 0's workers all exited 0 in this round (looked at each round); once its store is
        # then lost, this node finishes the round on its own (see _unless_host_done)
        self._host_done = self._alone = False

    def _options(self) -> dict:
        c = self._config
        spec = str(c.nnodes) if c.min_nnodes == c.nnodes else f"{c.min_nnodes}:{c.nnodes}"
        return {"nnodes": spec, "max_restarts": c.max_restarts}

    def _wait_for(self, key: str, what: str, deadline: float | None = None) -> str:
        """``key``'s value, once node 0 has set it; waited for until ``deadline`` (default:
        ``--rdzv-timeout`` from now)."""
        deadline = time.monotonic() + self._timeout if deadline is None else deadline
        while (value := self._s.read(key)) is None:
            self._raise_if()
            if time.monotonic() > deadline:
                raise RendezvousError(f"{self.me.label()}: node 0 did not {what} within "
                                      f"{self._timeout:g} s (--rdzv-timeout) at {self._s.where}")
            time.sleep(POLL_S)
        return value

    def start(self) -> None:
        """Register with node 0."""
        # the first meeting: --rdzv-timeout from the launcher's start, not from here
        self.run_id = json.loads(self._wait_for("job", "start the job",
                                                self._config.rdzv_deadline))["run_id"]
        self._register()

    def _register(self) -> None:
        arrival = int(self._s.add("joins", 1))
        self.me = replace(self.me, arrival=arrival)
        entry = {"node": asdict(self.me), "options": self._options()}
        self._s.set(f"join/{arrival}", json.dumps(entry))

    def _layout(self, decision: dict) -> Layout | None:
        layout = layout_for(self.me, decision, "127.0.0.1", self._workers_port, self.run_id)
        if layout is not None:
            self.members = [Node(**n) for n in decision["nodes"]]
            self._host_done = False
        return layout

    def _unless_host_done(self, call: Callable, alone):
        """``call()``; ``alone`` once the store is lost after node 0's workers all exited 0:
        node 0 finished its part, and its launcher leaving is no loss (each node then ends
        with its own workers' status)."""
        if self._alone:
            return alone
        try:
            return call()
        except StoreLost:
            if not self._host_done:
                raise
        self._alone = True
        self._note("node 0's workers had all exited 0 and its launcher is gone: "
                   f"{self.me.label()} finishes the round on its own")
        return alone

    def next_round(self, previous: Layout | None, restarts: int) -> Layout | RoundEnd:
        """Wait for a round with a place for this node; or the job's end (a record)."""
        expect = 0 if previous is None else previous.round + 1
        if previous is not None:
            self._s.set(_key(expect, f"ready/{self.me.id}"), "1")
        while True:
            self._raise_if()
            latest = self._s.read("latest")
            if latest is not None and int(latest) >= expect:
                decision = json.loads(self._s.read(_key(int(latest), "layout")))
                layout = self._layout(decision)
                if layout is not None:
                    return layout
                if previous is not None:
                    self._note(f"round {latest} has no place for {self.me.label()} (--nnodes "
                               f"{self._options()['nnodes']}); waiting for one")
                elif expect == 0:
                    self._note(f"the job runs round {latest}: {self.me.label()} joins at a "
                               "later one")
                expect = int(latest) + 1
            refusal = self._s.read(f"refused/{self.me.id}")
            if refusal is not None:
                self._refused = True
                try:  # node 0 may wait for this before it goes
                    self._s.set(f"refused/{self.me.id}/read", "1")
                except RendezvousError:
                    pass
                raise RendezvousError(refusal)
            final = self._s.read("final")
            if final is not None:
                return RoundEnd.from_json(final)
            time.sleep(POLL_S)

    def membership(self, round_: int) -> RoundEnd | None:
        """Node 0 watches the membership; the others learn of a change by the round's end.
        Here a node looks whether node 0's workers are all done."""
        def look() -> None:
            host = next(n for n in self.members if n.leader)
            self._host_done = self._s.check([_key(round_, f"done/{host.id}")])
        if not self._host_done:
            self._unless_host_done(look, None)
        return None

    def acknowledge(self, round_: int) -> None:
        """Say that this node saw round ``round_`` fail and is still here."""
        self._unless_host_done(lambda: self._s.set(_key(round_, f"ack/{self.me.id}"), "1"), None)

    def lost_in(self, round_: int) -> list[str]:
        """The nodes lost in failed round ``round_``, as node 0 decided."""
        return self._unless_host_done(lambda: json.loads(self._wait_for(
            _key(round_, "lost"), f"say who is left after round {round_}")), [])

    def publish_end(self, round_: int, record: RoundEnd) -> RoundEnd:
        return self._unless_host_done(lambda: RoundEnd.from_json(
            self._s.compare_set(_key(round_, "end"), "", record.to_json())), record)

    def end_record(self, round_: int) -> RoundEnd | None:
        text = self._unless_host_done(lambda: self._s.read(_key(round_, "end")), None)
        return None if text is None else RoundEnd.from_json(text)

    def report_done(self, round_: int) -> None:
        def report() -> None:
            self._s.set(_key(round_, f"done/{self.me.id}"), "1")
            self._s.add(_key(round_, "done"), 1)
        self._unless_host_done(report, None)

    def all_done(self, round_: int) -> bool:
        return self._unless_host_done(
            lambda: int(self._s.add(_key(round_, "done"), 0)) >= len(self.members), True)

    def finish(self, record: RoundEnd) -> None:
        """Node 0 tells the nodes outside a round how the job ended."""

    def check_out(self) -> None:
        """This node needs the store no more (node 0's may be gone already: fine). Once; not
        by a node node 0 refused, which node 0 does not wait for."""
        if self._checked_out or self._refused:
            return
        self._checked_out = True
        try:
            self._s.set(checked_out_key(self.me.id), "1")
        except RendezvousError:
            pass

    def close(self) -> None:
        self._s.release()


class LeaderBoard(NodeBoard):
    """Node 0: writes the job's options, admits or refuses each launcher, decides each
    round's nodes (see :mod:`phalanx.launcher.membership`)."""

    def __init__(self, *args, open_store: Callable[[], None], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._open_store = open_store
        self._known: dict[str, Node] = {}
        self._seen = 0  # registrations reviewed
        self._gone_seen, self._gone = -1, {}  # id -> EXITED or UNREACHABLE
        self._problems: list[str] = []
        self._started = False

    def start(self) -> None:
        self.run_id = self._config.run_id or self.me.id
        self._s.set("job", json.dumps({**self._options(), "run_id": self.run_id}))
        self._register()

    def _gone_ids(self) -> set[str]:
        count = int(self._s.add(GONE_COUNT, 0))
        if count != self._gone_seen:  # one look at the counter; the marks only when it moved
            self._gone_seen = count
            self._gone = {i: self._s.get(gone_key(i)).decode() for i in self._known
                          if self._s.check([gone_key(i)])}
        return set(self._gone)

    def _voters(self, before: list[Node]) -> int:
        """The last round's nodes that vote: all but those known to have exited."""
        return sum(1 for n in before if self._gone.get(n.id) != EXITED)

    def _silent(self, before: list[Node], staying: list[Node]) -> list[str]:
        """The last round's nodes that vote and are not here."""
        return [n.label() for n in before if n not in staying and self._gone.get(n.id) != EXITED]

    def _lost_majority(self, before: list[Node], staying: list[Node]) -> None:
        voters, away = self._voters(before), self._silent(before, staying)
        message = (f"{self.me.label()} lost the majority: {len(staying)} of the last round's "
                   f"{voters} node(s) that may still run ({', '.join(n.label() for n in staying)})"
                   f" are here, more than half are needed to go on ({', '.join(away)} cannot be "
                   f"reached). This side stops so that the job never runs twice (run id "
                   f"{self.run_id}); the other side goes on if it holds the majority")
        self.finish(RoundEnd("lost", detail=message))
        raise MajorityLost(message)

    def _review(self) -> None:
        """Admit or refuse the launchers that registered since the last look."""
        count = int(self._s.add("joins", 0))
        while self._seen < count:
            raw = self._s.read(f"join/{self._seen + 1}")
            if raw is None:  # counted, not written yet: at the next look
                return
            self._seen += 1
            entry = json.loads(raw)
            node = replace(Node(**entry["node"]), leader=entry["node"]["id"] == self.me.id)
            problem = self._problem(node, entry["options"])
            if problem is None:
                self._known[node.id] = node
                continue
            self._s.set(f"refused/{node.id}", problem)
            self._problems.append(problem)
            if not self._started and "disagree" in problem:  # misconfigured from the start
                # the refused node reads why from this node's store: let it, before ending
                deadline = time.monotonic() + REFUSAL_READ_S
                while (not self._s.check([f"refused/{node.id}/read"])
                       and time.monotonic() < deadline):
                    time.sleep(POLL_S)
                raise RendezvousError(problem)

    def _problem(self, node: Node, options: dict) -> str | None:
        mine = self._options()
        for key, flag in (("nnodes", "--nnodes"), ("max_restarts", "--max-restarts")):
            if options[key] != mine[key]:
                return (f"The launchers disagree on {flag}: node 0 has {mine[key]}, "
                        f"{node.name()} has {options[key]}; start every node with the same options")
        gone = self._gone_ids()
        holder = next((k for k in self._known.values() if k.id not in gone and k.id != node.id
                       and node.node_rank is not None and k.node_rank == node.node_rank), None)
        if holder is not None:
            return (f"Node rank {node.node_rank} is already taken at {self._s.where} by the "
                    f"launcher on {holder.host}: give each launcher its own --node-rank (a node "
                    "that replaces one is let in once the one it replaces has gone)")
        return None

    def next_round(self, previous: Layout | None, restarts: int) -> Layout:
        """Decide the next round's nodes (see the module docstring), open the workers' store
        and publish the decision; return node 0's layout in it."""
        round_ = 0 if previous is None else previous.round + 1
        before, ids = self.members, {n.id for n in self.members}
        began, last_call = time.monotonic(), None
        # the first round's wait ends --rdzv-timeout after the launcher started (its start, a
        # store helper and torch's import, may take seconds of it on a loaded machine)
        deadline = self._config.rdzv_deadline if round_ == 0 else began + self._timeout
        while True:
            self._raise_if()
            self._review()
            gone = self._gone_ids()
            staying = [n for n in before if n.id not in gone]
            unready = [n for n in staying if not n.leader
                       and not self._s.check([_key(round_, f"ready/{n.id}")])]
            newcomers = sorted((n for n in self._known.values()
                                if n.id not in gone and n.id not in ids), key=Node.order)
            ready = [n for n in staying if n not in unready] + newcomers
            if before and not majority(len(staying), self._voters(before)):
                self._lost_majority(before, staying)
            if not unready and len(ready) >= self._config.min_nnodes:
                if before or len(ready) >= self._config.nnodes:
                    last_call = time.monotonic()  # only the first round waits for latecomers
                elif last_call is None:
                    last_call = time.monotonic() + self._config.last_call_timeout
                if time.monotonic() >= last_call:
                    return self._open(round_, sorted(ready[: self._config.nnodes], key=Node.order),
                                      restarts)
            # --rdzv-timeout, and while nodes of the round before still stop their workers,
            # their --shutdown-timeout too
            if time.monotonic() > deadline + (self._config.shutdown_timeout if unready else 0.0):
                self._give_up(len(ready), unready, deadline - self._timeout, began)
            time.sleep(POLL_S)

    def _open(self, round_: int, chosen: list[Node], restarts: int) -> Layout:
        self._open_store()  # a fresh workers' store, up before any worker of the round starts
        decision = {"round": round_, "nodes": [asdict(n) for n in chosen], "restarts": restarts}
        self._s.set(_key(round_, "layout"), json.dumps(decision))
        self._s.set("latest", str(round_))
        self._started = True
        return self._layout(decision)

    def _give_up(self, ready: int, unready: list[Node], since: float, began: float) -> None:
        """Stop waiting for nodes: ``since`` the wait's start (the launcher's, for the first
        round), ``began`` when this launcher could first look at the board."""
        spec = self._options()["nnodes"]
        waited = time.monotonic() - since
        message = (f"Only {ready} of the {self._config.min_nnodes} node(s) needed (--nnodes "
                   f"{spec}) were ready after {waited:.0f} s (--rdzv-timeout "
                   f"{self._timeout:g}) at {self._s.where}")
        if began - since > self._timeout:  # nothing left of it to wait with: say why
            message += (f"; this launcher was ready only {began - since:.1f} s after its start "
                        "(its start and torch's import on a loaded machine count too)")
        if unready:
            message += f"; {', '.join(n.label() for n in unready)} did not stop its workers"
        if self._problems:
            message += "; refused: " + "; ".join(self._problems)
        self.finish(RoundEnd("lost", detail=message))
        raise RendezvousError(message)

    def membership(self, round_: int) -> RoundEnd | None:
        """A change that ends the round: one of its nodes is gone, or a newcomer waits for
        a place that exists."""
        self._review()
        gone = self._gone_ids()
        left = [n.label() for n in self.members if n.id in gone
                and not self._s.check([_key(round_, f"done/{n.id}")])]  # done: not lost
        if left:
            return RoundEnd("membership", detail=f"{', '.join(left)} left")
        members = {n.id for n in self.members}
        waiting = [n.label() for n in self._known.values() if n.id not in gone | members]
        if waiting and len(self.members) < self._config.nnodes:
            return RoundEnd("membership", detail=f"{', '.join(waiting)} joined")
        return None

    def acknowledge(self, round_: int) -> None:
        """Node 0 is never lost: the store would go with it."""

    def lost_in(self, round_: int) -> list[str]:
        deadline = time.monotonic() + ACK_WAIT_S
        while True:
            gone = self._gone_ids()
            silent = [n for n in self.members if not n.leader and n.id not in gone
                      and not self._s.check([_key(round_, f"ack/{n.id}")])]
            if not silent or time.monotonic() > deadline:
                break
            time.sleep(POLL_S)
        lost = [n.label() for n in self.members if n.id in gone or n in silent]
        self._s.set(_key(round_, "lost"), json.dumps(lost))
        return lost

    def finish(self, record: RoundEnd) -> None:
        self._s.set("final", record.to_json())

    def awaited_check_outs(self) -> list[str]:
        """The other launchers admitted: the store lingers until each has checked out or
        is gone. By id, not by count: one that checked out and then left is gone too, and
        must not stand in for one that has not checked out yet."""
        return [i for i in self._known if i != self.me.id]
