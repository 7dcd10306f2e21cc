"""The ledger's tables: their directories, columns and Parquet schemas (docs/reconcile.md).

```
OUT/messages/date=YYYY-MM-DD/broker=NAME/part-0.parquet    every record of a message: originals and copies
OUT/deliveries/date=YYYY-MM-DD/broker=NAME/part-0.parquet  per (message, consumer group): what happened
OUT/groups/broker=NAME/part-0.parquet                      the consumer groups of each subject
OUT/delayed/date=YYYY-MM-DD/server=NAME/part-0.parquet     a delay server's messages
OUT/_exports/NAME.json                                     when each store was read, and how far
```

`date` is the UTC day the message was first stored (for a copy: its original's), so a message's
rows share a partition. The partition columns come from the paths, not the files. Times are UTC
milliseconds.
"""

from __future__ import annotations

import pyarrow as pa

from qmq.protocol.envelope import PRODUCER_HEADER  # noqa: F401 - the ledger's readers take it from here

MESSAGES, DELIVERIES, GROUPS, DELAYED = "messages", "deliveries", "groups", "delayed"
EXPORTS_DIR = "_exports"  # readers such as Spark skip names starting with "_"
DATE, BROKER, SERVER = "date", "broker", "server"  # partition columns
PART_FILE = "part-0.parquet"

# messages.origin: how a record came to be stored
PRODUCER, RETRY, DEAD, REDRIVEN = "producer", "retry", "dead", "redriven"
# deliveries.status: where the message stands with the group
ACKED, IN_FLIGHT, RETRYING, DEAD_LETTERED = "acked", "in_flight", "retrying", "dead"

TS = pa.timestamp("ms", tz="UTC")

SCHEMAS: dict[str, pa.Schema] = {
    MESSAGES: pa.schema(
        [
            ("message_id", pa.string()),
            ("subject", pa.string()),  # the producer's subject, or an ordered message's `subject#queue`
            ("stored_subject", pa.string()),  # the subject, or %RETRY%subject%group, %DEAD%subject%group
            ("group", pa.string()),  # for a retry or dead-letter copy: its consumer group
            ("origin", pa.string()),  # PRODUCER, RETRY, DEAD or REDRIVEN
            ("attempt", pa.int32()),  # 1 for an original; the attempt a copy will be
            ("reason", pa.string()),  # a copy's last failure
            ("stored_at", TS),
            ("first_stored_at", TS),  # the original's store time (a copy keeps it)
            ("created_at", TS),  # the producer's clock, from the envelope
            ("producer", pa.string()),  # the PRODUCER_HEADER, when the producer set it
            ("size", pa.int32()),  # payload bytes
            ("offset", pa.int64()),  # in the broker's message log
        ]
    ),
    DELIVERIES: pa.schema(
        [
            ("message_id", pa.string()),
            ("subject", pa.string()),
            ("group", pa.string()),  # the consumer group (a broadcast consumer's own key)
            ("broadcast", pa.bool_()),
            ("times_delivered", pa.int32()),  # pulls that handed it out (retries and redeliveries included)
            ("first_delivered_at", TS),
            ("last_delivered_at", TS),
            ("acked_at", TS),  # the last acknowledgement of one of its deliveries
            ("status", pa.string()),  # ACKED, IN_FLIGHT, RETRYING or DEAD_LETTERED
            ("dead_lettered", pa.bool_()),  # status is DEAD_LETTERED
            ("dead_lettered_at", TS),  # the last time it went to the dead-letter subject (kept after a re-drive)
            ("attempts", pa.int32()),  # the highest attempt delivered
            ("first_stored_at", TS),
        ]
    ),
    GROUPS: pa.schema(
        [
            ("subject", pa.string()),
            ("group", pa.string()),
            ("broadcast", pa.bool_()),
            ("created_at", TS),  # the group's first pull on this broker
            ("start_seq", pa.int64()),  # where it started in the subject's consume log
        ]
    ),
    DELAYED: pa.schema(
        [
            ("message_id", pa.string()),
            ("subject", pa.string()),
            ("stored_at", TS),
            ("due_at", TS),
            ("created_at", TS),
            ("producer", pa.string()),
            ("dispatched", pa.bool_()),  # handed to a broker (acknowledged by it)
            ("cancelled", pa.bool_()),
        ]
    ),
}

PARTITION_OF = {MESSAGES: BROKER, DELIVERIES: BROKER, GROUPS: BROKER, DELAYED: SERVER}
DATED = (MESSAGES, DELIVERIES, DELAYED)  # partitioned by date too
