"""A message in the application's database (`qmq admin lookup --db`, the console's look-up): its
outbox row (was it committed, shipped, when, the last error) and the consumer groups whose handler
committed it (`qmq_consumed`, the idempotency records). Read-only; a missing table is no error (a
database may hold only one of them).
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from qmq.db.engine import create_engine

OUTBOX_COLUMNS = (
    "message_id",
    "subject",
    "key",
    "state",
    "attempts",
    "created_at",
    "sent_at",
    "deliver_at",
    "next_attempt_at",
    "last_error",
    "flagged_at",
)


def message_rows(db_url: str, message_id: str) -> dict[str, Any]:
    """{"outbox": row or None, "consumed": [{"consumer_group", "consumed_at"}], "errors": [...]}"""
    engine = create_engine(db_url)
    out: dict[str, Any] = {"outbox": None, "consumed": [], "errors": []}
    try:
        with engine.connect() as conn:
            try:
                row = (
                    conn.execute(
                        sa.text(f"SELECT {', '.join(OUTBOX_COLUMNS)} FROM qmq_outbox WHERE message_id = :id"),
                        {"id": message_id},
                    )
                    .mappings()
                    .first()
                )
                out["outbox"] = {k: _plain(v) for k, v in row.items()} if row else None
            except sa.exc.DBAPIError as exc:
                conn.rollback()
                out["errors"].append(f"qmq_outbox: {_first_line(exc)}")
            try:
                rows = conn.execute(
                    sa.text(
                        "SELECT consumer_group, consumed_at FROM qmq_consumed WHERE message_id = :id "
                        "ORDER BY consumed_at"
                    ),
                    {"id": message_id},
                ).mappings()
                out["consumed"] = [{k: _plain(v) for k, v in r.items()} for r in rows]
            except sa.exc.DBAPIError as exc:
                out["errors"].append(f"qmq_consumed: {_first_line(exc)}")
    except sa.exc.DBAPIError as exc:
        out["errors"].append(_first_line(exc))
    finally:
        engine.dispose()
    return out


def _plain(value: Any) -> Any:
    return value.isoformat() if hasattr(value, "isoformat") else value


def _first_line(exc: BaseException) -> str:
    return str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
