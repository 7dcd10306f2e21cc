"""The issue's "done when", with `qmq admin` only: an order was not billed; the operator finds its
message dead-lettered after 32 attempts and why, sees the worker, fixes the cause, re-drives the
message and watches it consumed. A real cluster with a token, a real worker, the shop's outbox in
PostgreSQL."""

from __future__ import annotations

from tests.apps.billing_schema import ATTEMPTS
from tests.support.operating import operated_cluster
from tests.support.worker import wait_for
from tests.test_admin import admin


def test_an_order_not_billed_found_redriven_and_consumed_with_qmq_admin(processes, pg_url, tmp_path) -> None:
    with operated_cluster(processes, pg_url, tmp_path) as cluster:
        env = cluster.env
        message_id = cluster.place_order(7, customer=42)

        def dead_letters() -> int:
            stats = admin("stats", "--json", env=env)
            return sum(g["dead"] for g in stats["groups"] if (g["subject"], g["group"]) == ("order.created", "billing"))

        wait_for(lambda: dead_letters() == 1, "the order's message is dead-lettered")
        assert "order.created" in admin("stats", env=env)

        # why: the dead letter, its attempts and reason, the body
        [dead] = admin("dead", "list", "order.created", "billing", "--json", env=env)["messages"]
        assert (dead["id"], dead["attempts"], dead["body"]) == (message_id, ATTEMPTS, {"order": 7, "customer": 42})
        assert "no billing account for customer 42" in dead["reason"]

        # its life, found by the order's key, with the outbox row
        found = admin("lookup", "--key", "order.created", "7", "--db", cluster.db_url, "--json", env=env)
        [message] = found["messages"]
        assert message["id"] == message_id and message["groups"] == {"billing": "dead"}
        events = [e["event"] for e in message["life"]]
        assert events[0] == "stored" and events[-1] == "dead"
        assert events.count("pulled") == ATTEMPTS and events.count("nacked") == ATTEMPTS - 1
        assert message["life"][-1]["attempt"] == ATTEMPTS
        assert found["database"][message_id]["outbox"]["state"] == "sent"
        assert found["database"][message_id]["consumed"] == []
        assert "now, per consumer group: billing dead" in admin("lookup", "--id", message_id, env=env)

        # the worker that failed it
        [worker] = admin("inspect", "--json", env=env)["workers"]
        assert (worker["app"], worker["pid"], worker["concurrency"], worker["pool"]) == (
            "billing",
            cluster.worker.pid,
            4,
            "threads",
        )
        assert worker["consumer"].startswith("billing@")

        # the cause fixed, the message re-driven, then consumed
        cluster.open_account(42, "acct-42")
        redriven = admin("dead", "redrive", "order.created", "billing", "--id", message_id, "--yes", "--json", env=env)
        assert redriven["redriven"] == 1
        wait_for(lambda: cluster.invoices() == [(7, "acct-42")], "the order is billed")

        def looked_up() -> dict:
            return admin("lookup", "--id", message_id, "--db", cluster.db_url, "--json", env=env)

        # the worker's ack follows the handler's commit (acks go out in batches, within a second)
        wait_for(lambda: looked_up()["messages"][0]["groups"] == {"billing": "consumed"}, "the broker has the ack")
        after = looked_up()
        assert [e["event"] for e in after["messages"][0]["life"]][-3:] == ["re-driven", "pulled", "acked"]
        assert [r["consumer_group"] for r in after["database"][message_id]["consumed"]] == ["billing"]
        assert dead_letters() == 0

        # without the token the servers answer nothing
        refused = admin("stats", env={**env, "QMQ_TOKEN": ""}, expect=1)
        assert "UNAUTHORIZED" in refused or "token" in refused
