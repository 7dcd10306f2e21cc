"""The meta server's state logic (qmq.meta.registry) on a real SQLite database, with a clock the test
moves by hand: route assignment, liveness, read-only flags and unregistering, without sockets."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa

from qmq.db.engine import create_engine
from qmq.db.migrate import upgrade
from qmq.meta.registry import DEFAULT_ROUTE_GROUPS, ROUTE_STATE_TTL_S, UNAVAILABLE_AFTER_S, Registry, UnknownGroup


class Clock:
    """Time that only moves when the test says so."""

    def __init__(self) -> None:
        self.now = datetime(2030, 1, 1, 12, 0, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def registry(tmp_path, clock):
    url = f"sqlite:///{tmp_path / 'meta.sqlite3'}"
    upgrade(url)
    engine = create_engine(url)
    yield Registry(engine, clock=clock)
    engine.dispose()


def brokers(registry: Registry, *groups: str) -> None:
    for i, group in enumerate(groups):
        registry.heartbeat(f"127.0.0.1:{30000 + i}", "broker", group)


def names(route) -> list[str]:
    return [g.name for g in route.groups]


def test_new_subject_gets_two_groups_least_loaded_first(registry) -> None:
    brokers(registry, "g1", "g2", "g3")
    assert names(registry.route("a", create=True)) == ["g1", "g2"]
    assert names(registry.route("b", create=True)) == ["g3", "g1"]  # g3 carries nothing yet
    assert names(registry.route("c", create=True)) == ["g2", "g3"]
    assert names(registry.route("a", create=True)) == ["g1", "g2"]  # stable once assigned
    assert DEFAULT_ROUTE_GROUPS == 2


def test_consumers_do_not_create_routes(registry) -> None:
    brokers(registry, "g1", "g2")
    assert registry.route("a", create=False).groups == ()
    assert registry.snapshot()["routes"] == []


def test_route_is_topped_up_when_groups_join(registry) -> None:
    brokers(registry, "g1")
    assert names(registry.route("a", create=True)) == ["g1"]
    registry.heartbeat("127.0.0.1:31000", "broker", "g2")
    registry.heartbeat("127.0.0.1:31001", "broker", "g3")
    route = registry.route("a", create=True)
    assert names(route) == ["g1", "g2"]
    assert route.added == ("g2",)


def test_unavailable_group_is_replaced_but_kept_for_consumers(registry, clock) -> None:
    brokers(registry, "g1", "g2", "g3")
    assert names(registry.route("a", create=True)) == ["g1", "g2"]
    clock.advance(UNAVAILABLE_AFTER_S - 1)
    registry.heartbeat("127.0.0.1:30000", "broker", "g1")
    registry.heartbeat("127.0.0.1:30002", "broker", "g3")
    clock.advance(2)  # g2 silent for 31 s
    route = registry.route("a", create=True)
    assert names(route) == ["g1", "g2", "g3"]
    assert [g.available for g in route.groups] == [True, False, True]
    consumer = registry.route("a", create=False)
    assert names(consumer) == ["g1", "g2", "g3"]


def test_liveness_boundary_and_comeback(registry, clock) -> None:
    registry.heartbeat("127.0.0.1:30000", "broker", "g1")
    clock.advance(UNAVAILABLE_AFTER_S)
    assert registry.groups()[0].available  # exactly 30 s: still available
    clock.advance(0.001)
    assert not registry.groups()[0].available
    assert registry.groups()[0].addresses == ("127.0.0.1:30000",)  # still listed, for consumers
    assert registry.heartbeat("127.0.0.1:30000", "broker", "g1").event == "available again"
    assert registry.groups()[0].available
    assert registry.heartbeat("127.0.0.1:30000", "broker", "g1").event is None


def test_read_only_groups_are_flagged_and_not_chosen(registry) -> None:
    brokers(registry, "g1", "g2", "g3")
    assert registry.set_read_only("g1", True)
    assert not registry.set_read_only("g1", True)  # no change
    route = registry.route("a", create=True)
    assert names(route) == ["g2", "g3"]
    assert registry.heartbeat("127.0.0.1:30000", "broker", "g1").read_only
    registry.route("b", create=True)
    assert registry.set_read_only("g2", True)
    route = registry.route("a", create=True)  # only g3 is writable, nothing to add
    assert [(g.name, g.read_only) for g in route.groups] == [("g2", True), ("g3", False)]
    with pytest.raises(UnknownGroup, match="nope"):
        registry.set_read_only("nope", True)


def test_unregister_and_delay_servers(registry, clock) -> None:
    registry.heartbeat("127.0.0.1:30000", "broker", "g1")
    registry.heartbeat("127.0.0.1:20890", "delay", None)
    route = registry.route("a", create=True)
    assert [(s.address, s.available) for s in route.delay_servers] == [("127.0.0.1:20890", True)]
    assert registry.unregister("127.0.0.1:30000")
    assert not registry.unregister("127.0.0.1:1")
    assert not registry.groups()[0].available
    assert registry.heartbeat("127.0.0.1:30000", "broker", "g1").event == "available again"


def test_naive_and_aware_timestamps_agree(registry, clock) -> None:
    """SQLite returns naive datetimes; they are the UTC the registry wrote."""
    registry.heartbeat("127.0.0.1:30000", "broker", "g1")
    server = registry.servers()[0]
    assert server.last_heartbeat_at == clock.now
    assert server.last_heartbeat_at.tzinfo is not None


def count_queries(engine: sa.Engine) -> list[str]:
    """The queries run on `engine` from now on (appended as they run; not BEGIN and the like)."""
    statements: list[str] = []

    def seen(conn, cursor, statement: str, *rest) -> None:
        if statement.lstrip().upper().startswith("SELECT"):
            statements.append(statement)

    sa.event.listen(engine, "before_cursor_execute", seen)
    return statements


def test_route_look_ups_reuse_the_servers_and_groups_read_a_moment_ago(registry, clock) -> None:
    """During a failover every producer asks for its route again: within ROUTE_STATE_TTL_S a look-up
    reads only the subject's route, not every server and group again."""
    brokers(registry, "g1", "g2", "g3")
    assert names(registry.route("a", create=True)) == ["g1", "g2"]
    statements = count_queries(registry.engine)
    assert names(registry.route("a", create=True)) == ["g1", "g2"]
    assert names(registry.route("b", create=False)) == []
    assert len(statements) == 2 and all("FROM qmq_meta_route" in s for s in statements), statements
    clock.advance(ROUTE_STATE_TTL_S)
    statements.clear()
    assert names(registry.route("a", create=True)) == ["g1", "g2"]
    assert len(statements) > 2 and not any("count(" in s.lower() for s in statements)  # no count of every route


def test_a_route_shows_this_processes_writes_at_once_and_another_meta_servers_after_a_moment(registry, clock) -> None:
    other = Registry(registry.engine, clock=clock)  # a second meta server on the same database
    brokers(registry, "g1", "g2")
    assert [g.writable for g in registry.route("a", create=True).groups] == [True, True]
    registry.set_read_only("g1", True)
    assert [g.writable for g in registry.route("a", create=False).groups] == [False, True]
    other.set_read_only("g2", True)
    assert [g.writable for g in registry.route("a", create=False).groups] == [False, True]  # not yet...
    clock.advance(ROUTE_STATE_TTL_S)
    assert [g.writable for g in registry.route("a", create=False).groups] == [False, False]  # ...now
    brokers(other, "g1", "g2", "g3")
    clock.advance(-1)  # a clock stepped back: read again
    assert names(registry.route("a", create=True)) == ["g1", "g2", "g3"]
