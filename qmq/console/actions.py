"""What the console changes: re-drive and purge dead letters, reset a consumer group's position.
Each action is asked for twice: the first POST shows what it will do and asks for confirmation, the
second (with `confirm`) does it. Each needs the right to act (`auth.Access`) and a valid CSRF token,
and each is logged: one line on the `qmq.console` logger, the console's own list (/actions), and
with --action-log a JSON line in that file.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from flask import Blueprint, abort, current_app, flash, redirect, render_template, request, session, url_for

from qmq.admin.positions import parse_position
from qmq.admin.views import errors, totals
from qmq.client.admin import Answer

log = logging.getLogger("qmq.console")

ACTIONS_KEPT = 500  # in the console's own list
KINDS = {"redrive": "Re-drive", "purge": "Purge", "reset": "Reset"}

actions = Blueprint("actions", __name__)


@dataclass(frozen=True)
class Done:
    at: float
    who: str  # the remote address, and "signed in" or not
    kind: str
    subject: str
    group: str
    detail: str  # which dead letters, or the position
    outcome: str
    ok: bool


class ActionLog:
    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._done: deque[Done] = deque(maxlen=ACTIONS_KEPT)

    def record(self, done: Done) -> None:
        d = done
        (log.info if d.ok else log.warning)(
            "action %s on %s/%s (%s) by %s: %s", d.kind, d.subject, d.group, d.detail, d.who, d.outcome
        )
        with self._lock:
            self._done.append(done)
            if self.path is not None:
                with self.path.open("a") as f:
                    f.write(json.dumps(asdict(done)) + "\n")

    def latest(self) -> list[Done]:
        with self._lock:
            return list(reversed(self._done))


def _seqs(values: list[str]) -> dict[str, list[int]] | None:
    """Form values "broker-group|seq" as sequences by broker group; None when none was chosen."""
    chosen: dict[str, list[int]] = {}
    for value in values:
        group, _, seq = value.rpartition("|")
        if not group or not seq.isdigit():
            abort(400, f"bad dead-letter reference {value!r}")
        chosen.setdefault(group, []).append(int(seq))
    return chosen or None


def _position(text: str) -> tuple[str | int, int | None]:
    try:
        return parse_position(text)
    except ValueError as exc:
        abort(400, str(exc))


@actions.post("/act/<kind>")
def act(kind: str) -> Any:
    console = current_app.extensions["qmq"]
    if kind not in KINDS:
        abort(404)
    if not console.access.can_act(session):
        abort(403, "sign in with the token to act" if not console.access.read_only else "this console is read-only")
    console.access.check_csrf(session, request.form.get("csrf"))
    subject, group = request.form.get("subject", ""), request.form.get("group", "")
    back = request.form.get("next") or url_for("pages.dead_group", subject=subject, group=group)
    if not back.startswith("/") or back.startswith("//"):  # this console's own pages only
        abort(400, "bad return address")
    chosen = request.form.getlist("seq")
    to = request.form.get("to", "")
    if kind == "reset":
        detail = f"to {to}"
        position = _position(to)
    else:
        detail = f"{len(chosen)} chosen" if chosen else "all"
    if request.form.get("confirm") != "yes":
        return render_template(
            "confirm.html",
            kind=kind,
            verb=KINDS[kind],
            subject=subject,
            group=group,
            chosen=chosen,
            to=to,
            detail=detail,
            back=back,
        )
    admin = console.admin
    if kind == "reset":
        answers: list[Answer] = admin.reset(subject, group, *position)
        outcome = ", ".join(f"{a.group} at {a.reply.get('cursor')}" for a in answers if a.ok and a.reply)
    elif kind == "redrive":
        answers = admin.redrive(subject, group, _seqs(chosen))
        outcome = f"{totals(answers, 'redriven')} re-driven"
    else:
        answers = admin.purge(subject, group, _seqs(chosen))
        outcome = f"{totals(answers, 'purged')} purged"
    failed = errors(answers)
    if failed:
        outcome += "; " + "; ".join(f"{e['group']}: {e['error']}" for e in failed)
    who = f"{request.remote_addr} ({'signed in' if session.get('signed_in') else 'no token set'})"
    console.actions.record(Done(time.time(), who, kind, subject, group, detail, outcome, not failed))
    flash(f"{KINDS[kind]} {subject} / {group}: {outcome}", "error" if failed else "ok")
    return redirect(back)
