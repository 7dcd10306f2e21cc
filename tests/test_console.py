"""`qmq console` in a real headless browser (Debian's chromium, driven by Playwright) against one real
cluster for all its checks: every page opens; a subject's backlog goes down on the page while a
worker consumes; the issue's done-when with the console only (an order dead-lettered after 32
attempts found, its message found by id, re-driven by clicking after signing in with the token, and
seen consumed); actions ask for confirmation and are logged; reading needs no token, acting does.
Screenshots are kept: under the test's temporary folder, and in $QMQ_ARTIFACTS/console when set.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Page, expect, sync_playwright

from qmq.client import Client, OutgoingMessage
from qmq.client.blocking import Admin
from tests.apps.billing_schema import ATTEMPTS
from tests.support.broker import ROOT
from tests.support.operating import TOKEN, OperatedCluster, operated_cluster
from tests.support.processes import ProcessManager, free_port, wait_for_port
from tests.support.worker import wait_for

CHROMIUM = os.environ.get("QMQ_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
UI_TIMEOUT_MS = 30_000  # what a page must show, at the latest (it refreshes every half second)
SHIPPED = 300  # order.shipped messages whose backlog the page watches go down
expect.set_options(timeout=UI_TIMEOUT_MS)


@dataclass
class Console:
    url: str
    cluster: OperatedCluster
    browser: Browser
    shots: list[Path]
    action_log: Path

    def page(self) -> Page:
        page = self.browser.new_page(viewport={"width": 1280, "height": 900})
        page.set_default_timeout(UI_TIMEOUT_MS)
        return page

    def shot(self, page: Page, name: str) -> None:
        path = self.shots[0] / f"{name}.png"
        page.screenshot(path=str(path), full_page=True)
        for extra in self.shots[1:]:
            shutil.copy(path, extra / path.name)

    def admin(self) -> Admin:
        return Admin(meta=self.cluster.meta, token=TOKEN)


def write_reconciliation(out: Path) -> None:
    """A finished reconciliation's files, written by the reconciliation's own report code."""
    from spark_etl.report import Findings, write_all

    counts = {"delivered": 41, "dead_lettered": 1}
    write_all(
        out,
        Findings(
            window={
                "since": "2026-11-19T00:00:00Z",
                "until": "2026-11-20T00:00:00Z",
                "as_of": "2026-11-20T06:00:00Z",
                "cutoff": "2026-11-19T23:45:00Z",
                "grace_s": 900.0,
            },
            sources={},
            counts=counts,
            per_subject={"order.created": counts},
            per_group=[],
            examples={
                "dead_lettered": [
                    {"message_id": "m-1", "subject": "order.created", "groups": ["billing"], "reason": "no account"}
                ]
            },
            thresholds={},
        ),
    )


@pytest.fixture(scope="module")
def console(tmp_path_factory, pg_url) -> Iterator[Console]:
    base = tmp_path_factory.mktemp("console")
    shots = [base / "screenshots"]
    if os.environ.get("QMQ_ARTIFACTS"):
        shots.append(Path(os.environ["QMQ_ARTIFACTS"]) / "console")
    for folder in shots:
        folder.mkdir(parents=True, exist_ok=True)
    write_reconciliation(base / "reports" / "2026-11-20")
    processes = ProcessManager(base)
    try:
        with operated_cluster(processes, pg_url, base) as cluster:
            port = free_port()
            proc = processes.start(
                [
                    "-m", "qmq", "console", "--port", str(port), "--meta", cluster.meta,
                    "--sample-interval", "0.5", "--refresh", "0.5", "--reports", str(base / "reports"),
                    "--db", cluster.db_url, "--action-log", str(base / "actions.jsonl"),
                ],
                name="console",
                env={"PYTHONPATH": str(ROOT), **cluster.env},
            )  # fmt: skip
            wait_for_port(port, proc)
            with sync_playwright() as playwright:
                browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
                try:
                    yield Console(f"http://127.0.0.1:{port}", cluster, browser, shots, base / "actions.jsonl")
                finally:
                    browser.close()
    finally:
        processes.stop_all()


def test_every_page_opens(console: Console) -> None:
    with Client(meta=console.cluster.meta, token=TOKEN) as client:
        client.send([OutgoingMessage("order.created", {"order": 1, "customer": 1}, deliver_at=in_an_hour())])
    page = console.page()
    pages = {
        "cluster": ("/", "Cluster"),
        "subjects": ("/subjects", "Subjects"),
        "groups": ("/groups", "Consumer groups"),
        "dead": ("/dead", "Dead letters"),
        "lookup": ("/lookup", "Find a message"),
        "delay": ("/delay", "Delay servers"),
        "workers": ("/workers", "Workers"),
        "reconcile": ("/reconcile", "The last reconciliation"),
        "actions": ("/actions", "Actions taken from this console"),
        "login": ("/login", "Sign in to act"),
    }
    for name, (path, heading) in pages.items():
        page.goto(console.url + path)
        expect(page.locator("h1").first).to_contain_text(heading)
        console.shot(page, f"page-{name}")
    page.goto(console.url + "/")
    expect(page.locator("#broker-groups")).to_contain_text(console.cluster.broker)
    expect(page.locator("#delay-servers")).to_contain_text(console.cluster.delay)
    page.goto(console.url + "/delay")
    expect(page.locator(".delay-server").first).to_contain_text("1 messages pending")
    expect(page.locator(".delay-server svg.chart rect[fill]")).to_have_count(1)
    page.goto(console.url + "/workers")
    expect(page.locator("#workers")).to_contain_text("billing")
    expect(page.locator("#workers")).to_contain_text(str(console.cluster.worker.pid))
    page.goto(console.url + "/reconcile")
    expect(page.locator("#reconcile-counts")).to_contain_text("dead lettered")
    expect(page.locator("#reconcile-counts")).to_contain_text("41")
    expect(page.locator("img[alt='anomalies per subject']")).to_be_visible()
    page.goto(console.url + "/groups/no.such/group")
    expect(page.locator("body")).to_contain_text("no consumer group")
    page.close()


def test_the_backlog_goes_down_on_the_page_as_a_worker_consumes(console: Console) -> None:
    with console.admin() as admin:
        assert all(a.ok for a in admin.group_create("order.shipped", "shipping", "earliest"))
    with Client(meta=console.cluster.meta, token=TOKEN) as client:
        results = client.send([OutgoingMessage("order.shipped", {"order": n}) for n in range(SHIPPED)])
    assert all(r.ok for r in results)
    page = console.page()
    page.goto(console.url + "/groups/order.shipped/shipping")
    backlog = page.locator("#backlog")
    expect(backlog).to_have_text(str(SHIPPED))
    console.shot(page, "backlog-before")
    console.cluster.start_worker("order.shipped", "shipping@%h", concurrency=2)
    seen = []
    deadline = time.monotonic() + UI_TIMEOUT_MS / 1000
    while time.monotonic() < deadline:  # read what the page shows as its live part refreshes
        text = backlog.text_content() or ""
        if text.isdigit() and (not seen or int(text) != seen[-1]):
            seen.append(int(text))
        if seen and seen[-1] == 0:
            break
        page.wait_for_timeout(100)
    assert seen[-1] == 0, seen
    assert any(0 < n < SHIPPED for n in seen), f"the page never showed the backlog going down: {seen}"
    assert seen == sorted(seen, reverse=True), seen
    expect(page.locator("figure svg.chart polyline").first).to_be_attached()
    console.shot(page, "backlog-after")
    page.goto(console.url + "/groups")
    expect(page.locator("tr[data-group='shipping'] .backlog")).to_have_text("0")
    expect(page.locator("tr[data-group='shipping'] svg.spark")).to_be_attached()
    page.close()


def test_an_order_not_billed_found_redriven_and_consumed_with_the_console(console: Console) -> None:
    cluster = console.cluster
    message_id = cluster.place_order(8, customer=43)
    page = console.page()

    # the operator sees dead letters, opens the group's, reads why
    page.goto(console.url + "/dead")
    expect(page.locator("#dead-groups")).to_contain_text("billing", timeout=60_000)  # the page refreshes itself
    page.get_by_role("link", name="billing").click()
    row = page.locator(f"#dead-letters tr[data-id='{message_id}']")
    expect(row).to_contain_text("no billing account for customer 43")
    expect(row.locator("td").nth(3)).to_have_text(str(ATTEMPTS))
    expect(row).to_contain_text('"customer": 43')
    expect(page.locator("#dead-letters input[type=checkbox]")).to_have_count(0)  # no token yet: read-only
    console.shot(page, "dead-letters")

    # finds the message by id: its life and the outbox row
    page.goto(console.url + "/lookup")
    page.locator("#lookup-id input[name=id]").fill(message_id)
    page.locator("#lookup-id button").click()
    message = page.locator(f"section.message[data-id='{message_id}']")
    expect(message.locator(".fates tr[data-group='billing'] .fate")).to_have_text("dead")
    expect(message.locator(".life tr.event.pulled")).to_have_count(ATTEMPTS)
    expect(message.locator(".life tr.event.dead")).to_contain_text(f"gave up after {ATTEMPTS} attempts")
    expect(page.locator("section.database")).to_contain_text("sent")
    expect(page.get_by_role("button", name="Re-drive it to billing…")).to_have_count(0)
    console.shot(page, "lookup-dead")

    # signs in with the token (a wrong one first), fixes the cause, re-drives by clicking, confirms
    page.goto(console.url + "/login")
    page.locator("input[name=token]").fill("not the token")
    page.get_by_role("button", name="Sign in").click()
    expect(page.locator(".flash.error")).to_contain_text("not the token")
    page.locator("input[name=token]").fill(TOKEN)
    page.get_by_role("button", name="Sign in").click()
    expect(page.locator(".flash.ok")).to_contain_text("signed in")
    cluster.open_account(43, "acct-43")
    page.goto(f"{console.url}/lookup?id={message_id}")
    page.get_by_role("button", name="Re-drive it to billing…").click()
    expect(page.locator(".question")).to_contain_text("Re-drive 1 chosen dead letters of consumer group billing")
    console.shot(page, "confirm-redrive")
    page.get_by_role("button", name="Yes, re-drive").click()
    expect(page.locator(".flash.ok")).to_contain_text("1 re-driven")
    fate = page.locator(f"section.message[data-id='{message_id}'] .fates tr[data-group='billing'] .fate")
    expect(fate).to_have_text("consumed")  # the page refreshes itself until the worker consumed it
    expect(page.locator("section.database")).to_contain_text("Consumed by group billing")
    console.shot(page, "lookup-consumed")
    assert (8, "acct-43") in cluster.invoices()

    # the action is logged: on the page and in the file
    page.goto(console.url + "/actions")
    expect(page.locator("#actions")).to_contain_text("redrive")
    expect(page.locator("#actions")).to_contain_text("1 re-driven")
    logged = [json.loads(line) for line in console.action_log.read_text().splitlines()]
    assert [(a["kind"], a["subject"], a["group"], a["outcome"]) for a in logged] == [
        ("redrive", "order.created", "billing", "1 re-driven")
    ]
    assert "signed in" in logged[0]["who"]
    page.close()


def test_purge_and_reset_ask_first_and_acting_needs_the_token(console: Console) -> None:
    cluster = console.cluster
    first, second = cluster.place_order(9, customer=44), cluster.place_order(10, customer=44)

    def dead() -> set[str]:
        with console.admin() as admin:
            return {m["id"] for a in admin.dead_list("order.created", "billing") for m in (a.reply or {})["messages"]}

    wait_for(lambda: {first, second} <= dead(), "both orders are dead-lettered")
    page = console.page()
    page.goto(console.url + "/login")
    page.locator("input[name=token]").fill(TOKEN)
    page.get_by_role("button", name="Sign in").click()

    # purge one chosen dead letter: cancelled first (nothing changes), then confirmed
    page.goto(console.url + "/dead/order.created/billing")
    page.get_by_label(f"choose {first}").check()
    page.get_by_role("button", name="Purge chosen (or all)…").click()
    expect(page.locator(".question")).to_contain_text("Purge 1 chosen dead letters")
    page.get_by_role("link", name="Cancel").click()
    expect(page.locator(f"#dead-letters tr[data-id='{first}']")).to_have_count(1)
    page.get_by_label(f"choose {first}").check()
    page.get_by_role("button", name="Purge chosen (or all)…").click()
    page.get_by_role("button", name="Yes, purge").click()
    expect(page.locator(".flash.ok")).to_contain_text("1 purged")
    expect(page.locator(f"#dead-letters tr[data-id='{first}']")).to_have_count(0)
    expect(page.locator(f"#dead-letters tr[data-id='{second}']")).to_have_count(1)

    # reset the shipping group back to its first message: asked, then done, and the backlog is back
    page.goto(console.url + "/groups/order.shipped/shipping")
    page.locator("input[name=to]").fill("earliest")
    page.get_by_role("button", name="Reset…").click()
    expect(page.locator(".question")).to_contain_text("Move consumer group shipping on order.shipped to earliest")
    page.get_by_role("button", name="Yes, reset").click()
    expect(page.locator(".flash.ok")).to_contain_text("at 0")
    console.shot(page, "after-reset")

    # without signing in, a page shows no actions and a forged post is refused
    other = console.browser.new_context().new_page()
    other.goto(console.url + "/dead/order.created/billing")
    expect(other.locator("#dead-letters")).to_contain_text(second)
    expect(other.get_by_role("button", name="Purge chosen (or all)…")).to_have_count(0)
    form = urllib.parse.urlencode({"subject": "order.created", "group": "billing", "confirm": "yes"}).encode()
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(console.url + "/act/purge", data=form, timeout=10)
    assert refused.value.code == 403
    assert second in dead()
    other.close()
    page.close()


def in_an_hour() -> int:
    return int(time.time() * 1000) + 3_600_000
