"""Masters, epochs and failover decisions (qmq/meta/election.py) on SQLite and PostgreSQL, with a
clock the test moves: the first to report is master; a silent master is replaced by the in-sync
replica with the longest log, one epoch up; only the lease holder decides; a master back with a
wiped log is replaced at once."""

from __future__ import annotations

import pytest

from qmq.meta.election import Election
from qmq.meta.registry import Registry
from qmq.protocol.limits import DELAY_GROUP_PREFIX
from tests.support.databases import migrated_engine
from tests.test_meta_registry import Clock

AFTER_S = 10.0


@pytest.fixture(params=["sqlite", "postgresql"])
def engine(request, tmp_path):
    with migrated_engine(request.param, request, tmp_path, "meta.sqlite3") as engine:
        yield engine


@pytest.fixture
def clock() -> Clock:
    return Clock()


def election(engine, clock, holder: str) -> Election:
    return Election(engine, failover_after_s=AFTER_S, clock=clock, holder=holder)


def test_first_reporter_is_master_and_a_silent_master_is_replaced(engine, clock) -> None:
    e = election(engine, clock, "meta-1")
    assert e.report("a:1", "g1", "pending", 0, 0, None).master == "a:1"
    b = e.report("b:1", "g1", "pending", 0, 0, None)
    assert (b.epoch, b.master, b.role_of("b:1"), b.members) == (1, "a:1", "replica", 1)
    e.report("c:1", "g1", "replica", 1, 300, None)
    e.report("b:1", "g1", "replica", 1, 500, None)
    e.report("a:1", "g1", "master", 1, 600, ["b:1"])  # c is not in sync
    assert e.sweep() == []  # everyone alive
    clock.advance(AFTER_S / 2)
    e.report("b:1", "g1", "replica", 1, 500, None)
    e.report("c:1", "g1", "replica", 1, 300, None)
    clock.advance(AFTER_S / 2 + 1)  # a silent for longer than failover_after
    e.report("b:1", "g1", "replica", 1, 500, None)
    e.report("c:1", "g1", "replica", 1, 900, None)  # longer log, but not in sync: never promoted
    [failover] = e.sweep()
    assert (failover.group, failover.epoch, failover.master, failover.old_master) == ("g1", 2, "b:1", "a:1")
    assert e.report("a:1", "g1", "master", 1, 600, ["b:1"]).master == "b:1"  # the old master learns
    assert e.sweep() == []


def test_a_master_every_in_sync_replica_lost_is_replaced_one_heartbeat_interval_sooner(engine, clock) -> None:
    """A crashed master's connections close at once: when every live in-sync replica says, after the
    master's last report, that it cannot reach it, failover_after less one heartbeat interval (10 s /
    4) is enough, so a failover counted from the crash stays under failover_after."""
    e = election(engine, clock, "meta-1")
    e.report("a:1", "g1", "pending", 0, 0, None)
    for replica in ("b:1", "c:1"):
        e.report(replica, "g1", "replica", 1, 500, None)
    e.report("a:1", "g1", "master", 1, 600, ["b:1", "c:1"])
    clock.advance(AFTER_S * 0.7)  # not yet failover_after less an interval (7.5 s)
    for replica in ("b:1", "c:1"):
        e.report(replica, "g1", "replica", 1, 500, None, master_lost=True)
    assert e.sweep() == []
    clock.advance(AFTER_S * 0.1)
    e.report("b:1", "g1", "replica", 1, 500, None, master_lost=True)
    e.report("c:1", "g1", "replica", 1, 510, None)  # c still reaches the master (a split, not a crash)
    assert e.sweep() == []
    e.report("c:1", "g1", "replica", 1, 510, None, master_lost=True)
    [failover] = e.sweep()
    assert (failover.epoch, failover.master, failover.old_master) == (2, "c:1", "a:1")
    assert "every in-sync replica lost its connection" in failover.reason

    # Lost reports older than the master's last report say nothing of it now.
    e.report("x:1", "g2", "pending", 0, 0, None)
    e.report("y:1", "g2", "replica", 1, 100, None, master_lost=True)
    e.report("x:1", "g2", "master", 1, 100, ["y:1"])
    clock.advance(AFTER_S * 0.9)
    assert e.sweep() == []
    clock.advance(AFTER_S * 0.2)  # failover_after: silent is silent
    e.report("y:1", "g2", "replica", 1, 100, None)
    [failover] = e.sweep()
    assert (failover.group, failover.master) == ("g2", "y:1") and "master silent" in failover.reason


def test_a_replica_silent_as_long_as_its_master_is_not_promoted(engine, clock) -> None:
    # a and b frozen (or cut off) together: b's last report is as old as a's, within failover_after
    # but past two heartbeat intervals (5 s); c, heard from just now, is promoted though its log is shorter
    e = election(engine, clock, "meta-1")
    e.report("a:1", "g1", "pending", 0, 0, None)
    e.report("b:1", "g1", "replica", 1, 600, None)
    e.report("c:1", "g1", "replica", 1, 500, None)
    e.report("a:1", "g1", "master", 1, 600, ["b:1", "c:1"])
    clock.advance(AFTER_S * 0.4)
    e.report("b:1", "g1", "replica", 1, 600, None)  # b's last word
    clock.advance(AFTER_S * 0.61)  # a silent past failover_after; b for 6.1 s
    assert e.sweep() == []  # c has not reported for as long either: nobody to promote yet
    e.report("c:1", "g1", "replica", 1, 500, None, master_lost=True)
    [failover] = e.sweep()
    assert (failover.epoch, failover.master) == (2, "c:1")


def test_no_in_sync_replica_means_no_failover(engine, clock) -> None:
    e = election(engine, clock, "meta-1")
    e.report("a:1", "g1", "master", 1, 100, [])
    e.report("b:1", "g1", "replica", 1, 100, None)
    clock.advance(AFTER_S + 1)
    e.report("b:1", "g1", "replica", 1, 100, None)
    assert e.sweep() == []
    assert e.assignment("g1").master == "a:1"


def test_only_the_lease_holder_decides_and_another_takes_over_when_it_lapses(engine, clock) -> None:
    first, second = election(engine, clock, "meta-1"), election(engine, clock, "meta-2")
    first.report("a:1", "g1", "master", 1, 100, ["b:1"])
    first.report("b:1", "g1", "replica", 1, 100, None)
    clock.advance(AFTER_S)
    first.report("b:1", "g1", "replica", 1, 100, None)
    assert first.sweep() == []  # the master is just alive; meta-1 takes the lease for AFTER_S / 2
    clock.advance(1)
    second.report("b:1", "g1", "replica", 1, 100, None)
    assert second.sweep() == []  # the master is silent now, but meta-1 holds the lease
    clock.advance(AFTER_S / 2)
    second.report("b:1", "g1", "replica", 1, 100, None)
    [failover] = second.sweep()  # meta-1 died without deciding: its lease lapsed, meta-2 decides
    assert (failover.epoch, failover.master) == (2, "b:1")
    assert first.sweep() == []  # meta-1 back: not the holder, and nothing left to do


def test_a_master_back_with_a_wiped_log_is_not_made_master_again(engine, clock) -> None:
    e = election(engine, clock, "meta-1")
    e.report("a:1", "g1", "master", 1, 1000, ["b:1"])
    e.report("b:1", "g1", "replica", 1, 1000, None)
    clock.advance(1)
    back = e.report("a:1", "g1", "pending", 0, 0, None)  # its first report after a restart on an empty disk
    assert (back.epoch, back.master, back.role_of("a:1")) == (2, "b:1", "replica")
    e.report("a:1", "g1", "replica", 2, 0, None)  # it follows: no report of its can empty the in-sync list
    assert e.assignment("g1").master == "b:1" and e.sweep() == []


def test_a_master_back_with_its_whole_log_stays_master(engine, clock) -> None:
    e = election(engine, clock, "meta-1")
    e.report("a:1", "g1", "master", 1, 1000, ["b:1"])
    e.report("b:1", "g1", "replica", 1, 1000, None)
    clock.advance(1)
    back = e.report("a:1", "g1", "pending", 0, 1000, None)  # restarted, its disk intact
    assert (back.epoch, back.master) == (1, "a:1")


def test_a_manual_switch_picks_an_in_sync_replica(engine, clock) -> None:
    e = election(engine, clock, "meta-1")
    e.report("a:1", "g1", "master", 1, 1000, ["b:1"])
    e.report("b:1", "g1", "replica", 1, 1000, None)
    assert e.switch("g1", to="c:1") is None
    switched = e.switch("g1")
    assert (switched.epoch, switched.master) == (2, "b:1")


def test_routes_name_a_delay_server_groups_master_only_and_follow_a_failover(engine, clock) -> None:
    registry = Registry(engine, clock=clock)
    e = election(engine, clock, "meta-1")
    for address in ("d:1", "d:2", "lone:1"):
        registry.heartbeat(address, "delay", None)
    e.report("d:1", f"{DELAY_GROUP_PREFIX}d1", "pending", 0, 0, None)  # first: master
    e.report("d:2", f"{DELAY_GROUP_PREFIX}d1", "pending", 0, 0, None)
    e.report("d:1", f"{DELAY_GROUP_PREFIX}d1", "master", 1, 100, ["d:2"])

    def routed() -> list[str]:
        return [s.address for s in registry.route("s", create=False).delay_servers]

    assert routed() == ["d:1", "lone:1"]  # the replica answers NOT_MASTER: left out; a lone one stays
    serves = {s["address"]: s["serves"] for s in registry.snapshot()["servers"]}
    assert serves == {"d:1": True, "d:2": False, "lone:1": True}
    clock.advance(AFTER_S + 1)
    registry.heartbeat("d:2", "delay", None)
    registry.heartbeat("lone:1", "delay", None)
    e.report("d:2", f"{DELAY_GROUP_PREFIX}d1", "replica", 1, 100, None)
    [failover] = e.sweep()
    assert (failover.group, failover.master) == ("delay:d1", "d:2")
    assert routed() == ["d:2", "lone:1"]


def test_a_serving_masters_report_made_before_its_replicas_is_not_a_lost_log(engine, clock) -> None:
    e = election(engine, clock, "meta-1")
    e.report("a:1", "g1", "master", 1, 1000, ["b:1"])
    e.report("b:1", "g1", "replica", 1, 1000, None)
    clock.advance(0.1)
    e.report("b:1", "g1", "replica", 1, 1101, None)  # it copied what the master appended since
    clock.advance(0.1)
    e.report("a:1", "g1", "master", 1, 1000, ["b:1"])  # made before that, recorded after: stale
    assert e.sweep() == []
    assert e.assignment("g1").master == "a:1"
