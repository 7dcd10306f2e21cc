"""The servers' administration answers (`qmq.client.admin.Answer`) as rows a person reads: figures
summed over broker groups, dead letters and looked-up messages with their bodies decoded and times
in ISO 8601, workers with what they run. Plain dicts and lists, so `qmq admin --json` prints them as
they are and the console's templates render them. No I/O.
"""

from __future__ import annotations

import base64
from datetime import UTC, datetime
from typing import Any

from qmq.client.admin import Answer
from qmq.protocol import envelope

GROUP_FIGURES = ("backlog", "in_flight", "retrying", "dead", "consumers", "acked")
MASTER = "master"


def iso(ms: int | None) -> str | None:
    """Milliseconds since the epoch as ISO 8601 UTC (`2026-11-20T06:30:00.123Z`)."""
    if ms is None:
        return None
    return datetime.fromtimestamp(ms / 1000, tz=UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def body_fields(payload: bytes | None) -> dict[str, Any]:
    """A payload's body as `qmq tail` prints it: a JSON value, text, or base64 with
    "body_encoding": "base64"; with its content type, headers and creation time."""
    env = envelope.decode(bytes(payload or b""))
    out: dict[str, Any] = {"content_type": env.content_type, "headers": env.headers, "created_at": iso(env.created_at)}
    if isinstance(env.body, bytes):
        out["body"] = base64.b64encode(env.body).decode()
        out["body_encoding"] = "base64"
    else:
        out["body"] = env.body
    return out


def errors(answers: list[Answer]) -> list[dict[str, str]]:
    return [{"group": a.group, "address": a.address, "error": a.error or ""} for a in answers if not a.ok]


def _counts(answer: Answer) -> bool:
    """Whether an answer's figures count: a replica's copy of its master's log would count twice."""
    return answer.ok and (answer.reply or {}).get("role", MASTER) == MASTER


def _add_rate(total: float | None, rate: float | None) -> float | None:
    if rate is None:
        return total
    return (total or 0.0) + rate


def stats_view(answers: list[Answer]) -> dict[str, Any]:
    """{"brokers": one row per server (role, replicas and lag when it reports them), "subjects",
    "groups": figures summed over the broker groups, "errors"}."""
    brokers, subjects, groups = [], {}, {}
    for answer in answers:
        reply = answer.reply or {}
        row = {
            "group": answer.group,
            "address": answer.address,
            "ok": answer.ok,
            "error": answer.error,
            "read_only": reply.get("read_only"),
            "role": reply.get("role"),
            "epoch": reply.get("epoch"),
            "replicas": reply.get("replicas"),
            "lag": reply.get("lag"),
            "subjects": len(reply.get("subjects") or {}),
        }
        brokers.append(row)
        if not _counts(answer):
            continue
        rates = reply.get("in_rates") or {}
        for subject, figures in (reply.get("subjects") or {}).items():
            item = subjects.setdefault(subject, {"subject": subject, "stored": 0, "in_rate": None, "broker_groups": []})
            item["stored"] += int(figures.get("stored") or 0)
            item["in_rate"] = _add_rate(item["in_rate"], rates.get(subject))
            item["broker_groups"].append(answer.group)
        for figures in reply.get("groups") or ():
            key = (figures["subject"], figures["group"])
            item = groups.setdefault(
                key,
                {"subject": key[0], "group": key[1], **dict.fromkeys(GROUP_FIGURES, 0), "out_rate": None},
            )
            for name in GROUP_FIGURES:
                item[name] += int(figures.get(name) or 0)
            item["out_rate"] = _add_rate(item["out_rate"], figures.get("out_rate"))
            item["broadcast"] = bool(figures.get("broadcast"))
    for item in subjects.values():
        item["groups"] = sorted(g for (s, g) in groups if s == item["subject"])
    return {
        "brokers": brokers,
        "subjects": sorted(subjects.values(), key=lambda s: s["subject"]),
        "groups": sorted(groups.values(), key=lambda g: (g["subject"], g["group"])),
        "errors": errors(answers),
    }


def _message(m: dict[str, Any]) -> dict[str, Any]:
    """What every view shows of a stored message: id, subject, key, tags, when stored, its body."""
    return {
        "id": m.get("id"),
        "subject": m.get("subject"),
        "key": m.get("key"),
        "tags": list(m.get("tags") or ()),
        "stored_at": iso(m.get("stored_at")),
        **body_fields(m.get("payload")),
    }


def dead_view(answers: list[Answer]) -> dict[str, Any]:
    """{"messages": every dead letter listed, with its broker group, decoded body, attempts and
    reason; "errors"}."""
    rows = []
    for answer in answers:
        for m in (answer.reply or {}).get("messages") or ():
            rows.append(
                {
                    "broker_group": answer.group,
                    "seq": m.get("seq"),
                    **_message(m),
                    "attempts": m.get("attempt"),
                    "reason": m.get("reason"),
                    "dead_at": iso(m.get("dead_at")),
                }
            )
    return {"messages": rows, "errors": errors(answers)}


def totals(answers: list[Answer], field: str) -> int:
    """The sum of one count over the answers (`redriven`, `purged`)."""
    return sum(int((a.reply or {}).get(field) or 0) for a in answers if a.ok)


def per_group(answers: list[Answer]) -> list[dict[str, Any]]:
    """One row per broker group: its reply, or its error."""
    return [{"group": a.group, "address": a.address, **(a.reply or {}), "error": a.error} for a in answers]


def _event(event: dict[str, Any]) -> dict[str, Any]:
    out = {**event, "at": iso(event.get("at"))}
    if "retry_at" in out:
        out["retry_at"] = iso(out["retry_at"])
    return out


def life_summary(life: list[dict[str, Any]], fates: dict[str, str]) -> list[dict[str, Any]]:
    """Per consumer group, what a long life comes to: deliveries, failures, the last reason, the
    fate now."""
    out = []
    for group, fate in fates.items():
        mine = [e for e in life if e.get("group") == group]
        failures = [e for e in mine if e["event"] in ("nacked", "dead", "released")]
        out.append(
            {
                "group": group,
                "deliveries": sum(1 for e in mine if e["event"] == "pulled"),
                "failures": len(failures),
                "last_reason": failures[-1].get("reason") if failures else None,
                "fate": fate,
                "since": mine[-1]["at"] if mine else None,
            }
        )
    return out


def lookup_view(brokers: list[Answer], delayed: list[Answer]) -> dict[str, Any]:
    """{"messages": each copy-set a broker holds, with its life and its fate per consumer group;
    "delayed": the delay servers' records of it; "errors"}."""
    messages, delays = [], []
    for answer in brokers:
        for m in (answer.reply or {}).get("messages") or ():
            messages.append(
                {
                    "broker_group": answer.group,
                    "broker": answer.address,
                    "seq": m.get("seq"),
                    **_message(m),
                    "copies": [{**c, "at": iso(c.get("at"))} for c in m.get("copies") or ()],
                    "life": [_event(e) for e in m.get("life") or ()],
                    "groups": dict(m.get("groups") or {}),
                    "truncated": bool(m.get("truncated")),
                }
            )
            messages[-1]["summary"] = life_summary(messages[-1]["life"], messages[-1]["groups"])
    for answer in delayed:
        for m in (answer.reply or {}).get("messages") or ():
            delays.append(
                {
                    "delay_server": answer.address,
                    **_message(m),
                    "deliver_at": iso(m.get("deliver_at")),
                    "state": m.get("state"),
                }
            )
    return {"messages": messages, "delayed": delays, "errors": errors(brokers) + errors(delayed)}


def workers_view(answers: list[Answer]) -> dict[str, Any]:
    """{"workers": one per consumer id that reported (host, pid, app, pool, concurrency, what it is
    running), with its consumers on every broker group; "consumers": every consumer, reported or
    not; "errors"}."""
    consumers, workers = [], {}
    for answer in answers:
        reply = answer.reply or {}
        for item in reply.get("consumers") or ():
            consumers.append({"broker_group": answer.group, **item})
        for consumer_id, report in (reply.get("workers") or {}).items():
            seen = workers.get(consumer_id)
            if seen is None or report.get("reported_s_ago", 0) < seen.get("reported_s_ago", 0):
                workers[consumer_id] = {"consumer": consumer_id, **report}
    for worker in workers.values():
        mine = [c for c in consumers if c["consumer"] == worker["consumer"]]
        worker["consumers"] = mine
        worker["in_flight"] = sum(c["in_flight"] for c in mine)
        worker["running"] = [
            {**r, "started_at": iso(r.get("started_at"))} if isinstance(r, dict) else r
            for r in worker.get("running") or ()
        ]
    return {
        "workers": sorted(workers.values(), key=lambda w: w["consumer"]),
        "consumers": sorted(consumers, key=lambda c: (c["subject"], c["group"], c["consumer"])),
        "errors": errors(answers),
    }


def delay_view(answers: list[Answer]) -> dict[str, Any]:
    """{"servers": each delay server's pending messages, per hour bucket ahead, and those due but
    waiting for a broker of their subject (parked: delay_server/parking.py), released after such an
    outage and going back tick by tick (`releasing`), or waiting for room to be read (`due_waiting`:
    a backlog beyond --max-held); "errors"}."""
    servers = []
    for answer in answers:
        if not answer.ok:
            continue
        reply = answer.reply or {}
        buckets = [{"bucket": name, "pending": n} for name, n in sorted((reply.get("buckets") or {}).items())]
        servers.append(
            {
                "address": answer.address,
                "now": iso(reply.get("now_ms")),
                "pending": reply.get("pending", 0),
                "bucket_minutes": reply.get("bucket_minutes"),
                "buckets": buckets,
                "fired": reply.get("fired", 0),
                "cancels_kept": reply.get("cancels_kept", 0),
                "parked": reply.get("parked", 0),
                "releasing": reply.get("releasing", 0),
                "due_waiting": reply.get("due_waiting", 0),
                "parked_subjects": [
                    {"subject": s, "count": n} for s, n in (reply.get("parked_subjects") or {}).items()
                ],
            }
        )
    return {"servers": servers, "errors": errors(answers)}
