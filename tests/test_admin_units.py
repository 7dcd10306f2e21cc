"""The administration's parts without I/O: the new journal entries and the dead letters handled one
by one (`BrokerState`), a message's life read from journal entries (`MessageLife`), the rates, and
the views that sum the brokers' answers, the administration calls' loops driven by hand."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import msgpack
import pytest

from qmq.admin.views import stats_view
from qmq.broker import journal
from qmq.broker.admin import RateMeter
from qmq.broker.consumer_group import Ack, Pull, Release
from qmq.broker.journal import Create, Delete, GroupAction, Redriven, Schedule
from qmq.broker.lookup import MessageLife
from qmq.broker.state import BrokerState
from qmq.broker.system_subjects import wrap
from qmq.client.admin import ADMIN_OPERATIONS, ADMIN_TIMEOUT_S, AdminCore, Answer
from qmq.client.aio import AsyncAdmin, AsyncClient
from qmq.client.blocking import Admin, Client
from qmq.client.core import CLIENT_OPERATIONS, ClientCore
from qmq.client.errors import ClientError, MetaUnreachable
from qmq.client.steps import Call
from qmq.protocol.codes import RequestCode
from qmq.protocol.errors import ErrorCode, RemoteError
from qmq.store.record import Record

DEAD = "%DEAD%orders%g"


def test_new_entries_round_trip_and_a_plain_redrive_keeps_its_old_form() -> None:
    entries = [
        Redriven(DEAD, 3, (5, 6, 9), False),
        Redriven(DEAD, 3, (), True),
        Delete("orders", "g", 12, 4),
    ]
    assert journal.decode(journal.encode(entries)) == entries
    assert msgpack.unpackb(journal.encode([Redriven(DEAD, 3)])) == [["D", DEAD, 3]]  # older brokers read it


def test_dead_letters_handled_one_by_one_then_the_mark_moves_over_them() -> None:
    state = BrokerState()
    state.apply(Redriven(DEAD, 0, (2, 4)), 0.0)
    assert state.redriven[DEAD] == 0 and state.dead_pending(DEAD, 6) == 4
    assert [s for s in range(6) if state.dead_is_done(DEAD, s)] == [2, 4]
    state.apply(Redriven(DEAD, 0, (0, 1), True), 0.0)  # purged: the mark runs over 0, 1, 2
    assert state.redriven[DEAD] == 3 and state.dead_done[DEAD] == {4}
    assert state.dead_pending(DEAD, 6) == 2  # 3 and 5
    restored = BrokerState.from_snapshot(state.to_snapshot(), 0.0)
    assert (restored.redriven, restored.dead_done) == (state.redriven, state.dead_done)
    state.apply(Redriven(DEAD, 6), 0.0)
    assert DEAD not in state.dead_done and state.dead_pending(DEAD, 6) == 0


def test_a_deleted_group_starts_clean_when_made_again() -> None:
    state = BrokerState()
    state.apply(Create("orders", "g", 0, False), 0.0)
    state.apply(GroupAction("orders", "g", Pull("c", 0, (0, 1), 2)), 0.0)
    state.apply(Create("%RETRY%orders%g", "g", 0, False), 0.0)
    state.apply(Delete("orders", "g", 7, 3), 0.0)
    assert state.group("orders", "g") is None
    assert state.group("%RETRY%orders%g", "g").cursor == 7  # old retries are not read again
    assert state.dead_pending(DEAD, 3) == 0


def record(subject: str, seq: int, offset: int, flags: int = 0, payload: bytes = b"x", ts: int = 0) -> Record:
    return Record(offset, 10, 0, flags, ts, seq, subject, "m1", "k", (), payload)


def copy(original: Record, subject: str, seq: int, offset: int, attempt: int, reason: str) -> Record:
    message = wrap(original, subject, attempt, reason)
    return Record(offset, 10, 0, message.flags, 0, seq, subject, "m1", "k", (), message.payload)


def test_a_life_with_a_retry_a_silent_consumer_and_a_dead_letter() -> None:
    original = record("orders", 4, 100)
    retry1 = copy(original, "%RETRY%orders%g", 0, 300, 2, "boom")
    retry2 = copy(retry1, "%RETRY%orders%g", 1, 500, 3, "consumer c2 went silent")
    dead = copy(retry2, DEAD, 0, 700, 3, "gave up after 3 attempts: boom")
    life = MessageLife()
    for c in (original, retry1, retry2, dead):
        life.add_copy(c)
    life.feed(200, 1, [GroupAction("orders", "g", Pull("c1", 0, (3, 4), 5))])
    life.feed(250, 2, [Schedule(0, 9, 100, 2, "%RETRY%orders%g", "boom")])
    life.feed(260, 3, [GroupAction("orders", "g", Ack("c1", 1))])  # settles the nacked pull: not "acked"
    life.feed(400, 4, [GroupAction("%RETRY%orders%g", "g", Pull("c2", 0, (0,), 1))])
    life.feed(550, 5, [GroupAction("%RETRY%orders%g", "g", Release("c2", 0))])
    life.feed(600, 6, [GroupAction("%RETRY%orders%g", "g", Pull("c1", 0, (1,), 2))])
    life.feed(800, 8, [GroupAction("%RETRY%orders%g", "g", Ack("c1", 0))])
    events = [(e["event"], e.get("consumer") or e.get("reason")) for e in life.events()]
    assert events == [
        ("stored", None),
        ("pulled", "c1"),
        ("nacked", "boom"),
        ("retry", "boom"),
        ("pulled", "c2"),
        ("retry", "consumer c2 went silent"),
        ("released", "c2"),
        ("pulled", "c1"),
        ("dead", "gave up after 3 attempts: boom"),
    ]
    assert life.groups() == {"g": "dead"}


def test_rates_over_the_window() -> None:
    meter = RateMeter()
    assert meter.rate(0.0, "s", 5) is None
    meter.sample(0.0, {"s": 0})
    assert meter.rate(0.5, "s", 5) is None  # too soon to say
    assert meter.rate(10.0, "s", 50) == 5.0
    for t in range(5, 130, 5):
        meter.sample(float(t), {"s": t})
    assert meter.samples[0][0] >= 130 - 5 - 60  # older samples dropped
    assert meter.rate(130.0, "s", 130) == 1.0


def test_stats_are_summed_over_masters_only() -> None:
    def reply(role: str | None, stored: int) -> dict:
        out = {
            "subjects": {"s": {"stored": stored}},
            "in_rates": {"s": 1.5},
            "groups": [{"subject": "s", "group": "g", "backlog": stored, "dead": 1, "out_rate": None}],
        }
        return {**out, "role": role} if role else out

    view = stats_view(
        [
            Answer("a", "h:1", reply("master", 10)),
            Answer("a", "h:2", reply("replica", 10)),  # the same log again: not counted
            Answer("b", "h:3", reply(None, 5)),  # no replication: counted
            Answer("c", "h:4", error="UNAVAILABLE: down"),
        ]
    )
    assert view["subjects"] == [
        {"subject": "s", "stored": 15, "in_rate": 3.0, "broker_groups": ["a", "b"], "groups": ["g"]}
    ]
    assert (view["groups"][0]["backlog"], view["groups"][0]["dead"]) == (15, 2)
    assert [b["role"] for b in view["brokers"]] == ["master", "replica", None, None]
    assert view["errors"] == [{"group": "c", "address": "h:4", "error": "UNAVAILABLE: down"}]


# ---- the administration calls' loops, driven by hand ---------------------------------------------


class Core(AdminCore):
    def __init__(self, meta: str | None = "m:1", brokers: tuple[str, ...] = (), delay: tuple[str, ...] = ()) -> None:
        self.meta, self.brokers, self.delay_servers = meta, brokers, delay


META_LIST = {
    "now": "2026-11-20T00:00:00+00:00",
    "groups": [
        {"name": "a", "addresses": ["h:1", "h:2"], "available": True, "read_only": False, "master": "h:2"},
        {"name": "b", "addresses": ["h:3"], "available": True, "read_only": True},
        {"name": "c", "addresses": [], "available": False},
    ],
    "servers": [
        {"address": "d:1", "kind": "delay", "available": True},
        {"address": "d:2", "kind": "delay", "available": False},
    ],
    "routes": [{"subject": "orders", "groups": ["a"]}],
}


def drive(loop: Generator, *outcomes: Any) -> tuple[list[Any], Any]:
    """Run a loop, answering its steps with `outcomes` in turn; (the steps, the result)."""
    steps, answers = [], iter(outcomes)
    try:
        step = next(loop)
        while True:
            steps.append(step)
            step = loop.send(next(answers))
    except StopIteration as end:
        return steps, end.value


def test_stats_ask_every_server_and_dead_letters_only_the_subjects_groups_at_their_master() -> None:
    steps, answers = drive(Core().stats(), META_LIST, [{"groups": []}, {}, RemoteError(ErrorCode.UNAVAILABLE, "down")])
    assert steps[0] == Call("m:1", RequestCode.META_LIST, {}, ADMIN_TIMEOUT_S)
    assert [(c.address, c.code) for c in steps[1].calls] == [
        (a, RequestCode.BROKER_STATS) for a in ("h:1", "h:2", "h:3")
    ]
    assert [a.ok for a in answers] == [True, True, False]
    assert "down" in answers[2].error
    steps, answers = drive(Core().dead_list("orders", "g", 7), META_LIST, [{"messages": []}])
    assert steps[1].calls == [
        Call("h:2", RequestCode.BROKER_DEAD_LIST, {"subject": "orders", "group": "g", "max": 7}, ADMIN_TIMEOUT_S)
    ]
    steps, _ = drive(Core().dead_list("unrouted", "g"), META_LIST, [{}, {}])
    assert [c.address for c in steps[1].calls] == ["h:2", "h:3"]  # no route: every group that has a server


def test_chosen_dead_letters_go_to_their_own_broker_group() -> None:
    steps, answers = drive(Core().redrive("orders", "g", {"b": [4, 9]}), META_LIST, [{"redriven": 2}])
    assert steps[1].calls == [
        Call(
            "h:3", RequestCode.BROKER_DEAD_REDRIVE, {"subject": "orders", "group": "g", "seqs": [4, 9]}, ADMIN_TIMEOUT_S
        )
    ]
    assert answers[0].reply == {"redriven": 2}
    with pytest.raises(ClientError, match="no broker group named zz"):
        drive(Core().purge("orders", "g", {"zz": [1]}), META_LIST)


def test_a_lookup_asks_the_meta_server_once_then_brokers_then_delay_servers() -> None:
    steps, (brokers, delayed) = drive(Core().lookup("m-1"), META_LIST, [{}, {}], [{"messages": []}])
    assert [type(s).__name__ for s in steps] == ["Call", "Calls", "Calls"]
    assert [c.code for c in steps[2].calls] == [RequestCode.DELAY_LOOKUP]
    assert [c.address for c in steps[2].calls] == ["d:1"]  # the available delay servers only
    assert len(brokers) == 2 and len(delayed) == 1
    with pytest.raises(ValueError, match="by id, or by subject and key"):
        drive(Core().lookup(subject="orders"))


def test_servers_given_directly_and_a_meta_server_that_does_not_answer() -> None:
    steps, _ = drive(Core(None, ("b:1", "b:2"), ("d:9",)).group_delete("s", "g", True), [{}, {}])
    assert [(c.address, c.body["force"]) for c in steps[0].calls] == [("b:1", True), ("b:2", True)]
    with pytest.raises(MetaUnreachable, match="cannot ask the meta server at m:1"):
        drive(Core().stats(), ConnectionRefusedError("refused"))


def test_both_drivers_bind_every_operation() -> None:
    """An operation added to AdminCore but not to ADMIN_OPERATIONS would be a generator, not a call."""
    public = {name for name in vars(AdminCore) if not name.startswith("_") and callable(vars(AdminCore)[name])}
    assert public == set(ADMIN_OPERATIONS)
    for name in ADMIN_OPERATIONS:
        assert getattr(Admin, name).__wrapped__ is getattr(AdminCore, name)
        assert getattr(AsyncAdmin, name).__wrapped__ is getattr(AdminCore, name)
    for name in CLIENT_OPERATIONS:
        assert getattr(Client, name).__wrapped__ is getattr(ClientCore, name)
        assert getattr(AsyncClient, name).__wrapped__ is getattr(ClientCore, name)
