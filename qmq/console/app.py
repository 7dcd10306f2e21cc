"""The console's Flask application and its pages, each a view over the administration calls:

    /                       the cluster: meta server, broker groups (role, lag), servers, delay servers
    /subjects               subjects: stored, rate in, consumer groups
    /groups                 consumer groups: backlog, in flight, retrying, dead, rates
    /groups/SUBJECT/GROUP   one group: its backlog and rates over time (charts), consumers, reset
    /dead                   groups with dead letters;  /dead/SUBJECT/GROUP: the letters, re-drive, purge
    /lookup?id=ID           a message (or ?subject=S&key=K) and its life, with its outbox row given --db
    /delay                  delay servers: pending messages per hour ahead
    /workers                running workers and what they run (the brokers' heartbeat reports)
    /reconcile              the last reconciliation's report (--reports DIR)
    /actions                what was done from this console

A server that does not answer is named on the page; the meta server unreachable gives a page that
says so (503), never a stack trace.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flask import (
    Blueprint,
    Flask,
    abort,
    current_app,
    flash,
    redirect,
    render_template,
    request,
    send_file,
    session,
    url_for,
)

from qmq.admin.database import message_rows
from qmq.admin.views import dead_view, delay_view, iso, lookup_view, stats_view, workers_view
from qmq.client import ClientError
from qmq.client.blocking import Admin
from qmq.console import chart
from qmq.console.actions import ActionLog, actions
from qmq.console.auth import Access
from qmq.console.history import History
from qmq.console.reports import read_report

DEFAULT_REFRESH_S = 5.0  # live parts of a page are fetched again this often

pages = Blueprint("pages", __name__)


@dataclass
class Console:
    """What the pages work with (`app.extensions["qmq"]`)."""

    admin: Admin
    history: History
    access: Access
    actions: ActionLog
    refresh_s: float = DEFAULT_REFRESH_S
    reports: Path | None = None
    db_url: str | None = None
    started: dict[str, Any] = field(default_factory=dict)


def console() -> Console:
    return current_app.extensions["qmq"]


def create_app(state: Console) -> Flask:
    app = Flask(__name__)
    app.secret_key = secrets.token_bytes(32)  # sessions live as long as the process
    app.config.update(SESSION_COOKIE_HTTPONLY=True, SESSION_COOKIE_SAMESITE="Strict")
    app.extensions["qmq"] = state
    app.register_blueprint(pages)
    app.register_blueprint(actions)
    app.jinja_env.filters["rate"] = lambda v: "-" if v is None else f"{v:.1f}/s"
    app.jinja_env.filters["dash"] = lambda v: "-" if v in (None, "") else v
    app.jinja_env.filters["when"] = lambda at: iso(int(at * 1000))

    @app.context_processor
    def common() -> dict[str, Any]:
        c = console()
        return {
            "can_act": c.access.can_act(session),
            "access": c.access,
            "signed_in": bool(session.get("signed_in")),
            "csrf": c.access.csrf_token(session),
            "refresh_s": c.refresh_s,
            "sampling_error": c.history.last_error,
        }

    @app.errorhandler(ClientError)
    def unreachable(exc: ClientError) -> tuple[str, int]:
        return render_template("error.html", message=str(exc)), 503

    return app


# ---- the cluster ------------------------------------------------------------------------------------


@pages.get("/")
def cluster() -> str:
    c = console()
    view = c.admin.cluster()
    stats = stats_view(c.admin.stats())
    delay = delay_view(c.admin.delay_stats())
    pending = {s["address"]: s["pending"] for s in delay["servers"]}
    return render_template(
        "cluster.html",
        cluster=view,
        brokers=stats["brokers"],
        delay_servers=[{**s, "pending": pending.get(s["address"])} for s in view.delay_servers],
        errors=stats["errors"] + delay["errors"],
    )


@pages.get("/subjects")
def subjects() -> str:
    stats = stats_view(console().admin.stats())
    return render_template("subjects.html", subjects=stats["subjects"], errors=stats["errors"])


@pages.get("/groups")
def groups() -> str:
    c = console()
    stats = stats_view(c.admin.stats())
    lines = {
        (g["subject"], g["group"]): chart.sparkline(
            [(s.at, s.backlog) for s in c.history.group(g["subject"], g["group"])]
        )
        for g in stats["groups"]
    }
    return render_template("groups.html", groups=stats["groups"], lines=lines, errors=stats["errors"])


@pages.get("/groups/<subject>/<group>")
def group(subject: str, group: str) -> str:
    c = console()
    stats = stats_view(c.admin.stats())
    row = next((g for g in stats["groups"] if g["subject"] == subject and g["group"] == group), None)
    if row is None and not stats["errors"]:
        abort(404, f"no consumer group {group} on {subject}")
    samples = c.history.group(subject, group)
    subject_samples = c.history.subject(subject)
    figures = chart.line_chart(
        f"{subject} / {group}: messages",
        [
            ("backlog", [(s.at, s.backlog) for s in samples]),
            ("in flight", [(s.at, s.in_flight) for s in samples]),
            ("retrying", [(s.at, s.retrying) for s in samples]),
            ("dead", [(s.at, s.dead) for s in samples]),
        ],
    )
    rates = chart.line_chart(
        f"{subject} / {group}: messages per second",
        [
            ("in (stored)", [(s.at, s.in_rate) for s in subject_samples]),
            ("out (acked)", [(s.at, s.out_rate) for s in samples]),
        ],
        unit="/s",
    )
    consumers = [
        x
        for x in workers_view(c.admin.consumers())["consumers"]
        if x["subject"] in (subject, f"%RETRY%{subject}%{group}")
    ]
    consumers = [x for x in consumers if x["group"] == group]
    return render_template(
        "group.html",
        subject=subject,
        group=group,
        row=row,
        figures=figures,
        rates=rates,
        consumers=consumers,
        samples=len(samples),
        sample_interval_s=c.history.interval_s,
        history_s=c.history.history_s,
        errors=stats["errors"],
    )


# ---- dead letters -----------------------------------------------------------------------------------


@pages.get("/dead")
def dead() -> str:
    stats = stats_view(console().admin.stats())
    with_dead = [g for g in stats["groups"] if g["dead"]]
    return render_template("dead.html", groups=with_dead, errors=stats["errors"])


@pages.get("/dead/<subject>/<group>")
def dead_group(subject: str, group: str) -> str:
    view = dead_view(console().admin.dead_list(subject, group, 500))
    return render_template("dead_group.html", subject=subject, group=group, **view)


# ---- one message ------------------------------------------------------------------------------------


@pages.get("/lookup")
def lookup() -> str:
    c = console()
    message_id = request.args.get("id", "").strip() or None
    subject = request.args.get("subject", "").strip() or None
    key = request.args.get("key", "").strip() or None
    view = None
    if message_id or (subject and key):
        view = lookup_view(*c.admin.lookup(message_id, subject, key))
        if c.db_url:
            ids = [message_id] if message_id else list(dict.fromkeys(m["id"] for m in view["messages"]))
            view["database"] = {i: message_rows(c.db_url, i) for i in ids}
    elif subject or key:
        abort(400, "look up by id, or by subject and key")
    return render_template("lookup.html", view=view, message_id=message_id, subject=subject, key=key)


# ---- delay servers, workers, reconciliation, actions -------------------------------------------------


@pages.get("/delay")
def delay() -> str:
    view = delay_view(console().admin.delay_stats())
    bars = {
        s["address"]: chart.bar_chart(
            f"{s['address']}: pending per bucket", [(b["bucket"], b["pending"]) for b in s["buckets"]]
        )
        for s in view["servers"]
    }
    return render_template("delay.html", servers=view["servers"], bars=bars, errors=view["errors"])


@pages.get("/workers")
def workers() -> str:
    view = workers_view(console().admin.consumers())
    return render_template("workers.html", **view)


@pages.get("/reconcile")
def reconcile() -> str:
    c = console()
    report = read_report(c.reports) if c.reports else None
    return render_template("reconcile.html", report=report, configured=c.reports is not None)


@pages.get("/reconcile/anomalies.png")
def reconcile_chart() -> Any:
    c = console()
    report = read_report(c.reports) if c.reports else None
    if not report or not report["chart"]:
        abort(404)
    return send_file(report["chart"], mimetype="image/png")


@pages.get("/actions")
def action_log() -> str:
    return render_template("actions.html", done=console().actions.latest())


# ---- signing in ---------------------------------------------------------------------------------------


@pages.route("/login", methods=["GET", "POST"])
def login() -> Any:
    c = console()
    if request.method == "POST":
        c.access.check_csrf(session, request.form.get("csrf"))
        if c.access.sign_in(session, request.form.get("token", "")):
            flash("signed in: actions are allowed", "ok")
            return redirect(url_for("pages.cluster"))
        flash("that is not the token", "error")
    return render_template("login.html")


@pages.post("/logout")
def logout() -> Any:
    c = console()
    c.access.check_csrf(session, request.form.get("csrf"))
    c.access.sign_out(session)
    return redirect(url_for("pages.cluster"))
