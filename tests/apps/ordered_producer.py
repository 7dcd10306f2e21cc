"""An application process for the ordering tests: commits ordered messages through the outbox.

    python -m tests.apps.ordered_producer DB_URL META SUBJECT ROUNDS KEY [KEY ...]

For each round, for each key, one transaction locks the key's row in `ordered_entities` (as an app
locks the business entity), takes the key's next sequence number there and sends `{"key", "seq"}`
with `order_key=key`, so outbox order is sequence order for every key, whichever process commits.
QMQ_TEST_ROUND_PAUSE_S: a pause before each round; QMQ_TEST_GATE_FILE: half-way, wait until that
file exists, so a test can change things between the halves; QMQ_TEST_AFTER_COMMIT=0: every message
is left to the relays; QMQ_TEST_TARGET=N: instead of rounds, send until every key's sequence is N,
sharing the work with the other processes. Prints "done" when every transaction committed and the sender is idle.
"""

from __future__ import annotations

import os
import sys
import time

import sqlalchemy as sa

import qmq
from qmq.db.engine import create_engine

NEXT_SEQ = sa.text("UPDATE ordered_entities SET seq = seq + 1 WHERE order_key = :key RETURNING seq")


NEXT_SEQ_UPTO = sa.text(
    "UPDATE ordered_entities SET seq = seq + 1 WHERE order_key = :key AND seq < :target RETURNING seq"
)


def main(db_url: str, meta: str, subject: str, rounds: int, keys: list[str]) -> None:
    engine = create_engine(db_url)
    producer = qmq.Producer(meta=meta, engine=engine, after_commit=os.environ.get("QMQ_TEST_AFTER_COMMIT") != "0")
    if os.environ.get("QMQ_TEST_TARGET"):
        until_target(engine, producer, subject, keys, int(os.environ["QMQ_TEST_TARGET"]))
        return
    pause = float(os.environ.get("QMQ_TEST_ROUND_PAUSE_S", "0"))
    gate = os.environ.get("QMQ_TEST_GATE_FILE")
    for round_ in range(rounds):
        time.sleep(pause)
        if gate and round_ == rounds // 2:
            print("waiting at the gate", flush=True)
            while not os.path.exists(gate):
                time.sleep(0.05)
        for key in keys:
            with engine.begin() as conn:
                seq = conn.execute(NEXT_SEQ, {"key": key}).scalar_one()
                producer.send(subject, {"key": key, "seq": seq}, order_key=key, connection=conn)
    producer.flush(60)
    print("done", flush=True)
    producer.close()


def until_target(engine: sa.Engine, producer: qmq.Producer, subject: str, keys: list[str], target: int) -> None:
    """Send until every key's sequence reached `target`, however many processes share the work (and
    whichever was killed and started again)."""
    left = list(keys)
    while left:
        still = []
        for key in left:
            with engine.begin() as conn:
                seq = conn.execute(NEXT_SEQ_UPTO, {"key": key, "target": target}).scalar()
                if seq is not None:
                    producer.send(subject, {"key": key, "seq": seq}, order_key=key, connection=conn)
                    still.append(key)
        left = still
    producer.flush(120)
    print("done", flush=True)
    producer.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5:])
