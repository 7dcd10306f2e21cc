"""Writing ledger rows as Parquet, one file per (table, date, store), each replaced atomically.

Rows are written as they come, a row group at a time, into a file readers skip (a leading dot),
renamed over the old one at the end: a reader (Spark, in the middle of a reconciliation) sees a day
of a store whole, old or new, never half. Re-exporting a day replaces that store's file for the day;
other stores' files are untouched, so any number of brokers export into one ledger directory.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from qmq.ledger import tables as t
from qmq.ledger.replay import day_of
from qmq.store.files import replace_durably

ROW_GROUP_ROWS = 100_000  # rows held in memory per open day before they are written
COMPRESSION = "zstd"


def partition_dir(out: Path, table: str, source: str, date: str | None = None) -> Path:
    path = out / table
    if date is not None:
        path = path / f"{t.DATE}={date}"
    return path / f"{t.PARTITION_OF[table]}={source}"


def _tmp(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


class DayFiles:
    """The files of one table of one store, by the UTC day of each row's `date_column`. Days in
    `keep_existing` that already have a file are left alone (the store no longer holds all of them).
    `add` rows, then `commit` (or `abort`)."""

    def __init__(
        self, out: Path, table: str, source: str, date_column: str, keep_existing: frozenset[str] = frozenset()
    ) -> None:
        self.out, self.table, self.source, self.date_column = out, table, source, date_column
        self.keep_existing = keep_existing
        self.schema = t.SCHEMAS[table]
        self._buffers: dict[str, list[dict[str, Any]]] = {}
        self._writers: dict[str, pq.ParquetWriter] = {}
        self.rows: dict[str, int] = {}  # day -> rows written
        self.kept: set[str] = set()  # days left as an earlier export wrote them

    def _path(self, day: str) -> Path:
        return partition_dir(self.out, self.table, self.source, day) / t.PART_FILE

    def add(self, row: dict[str, Any]) -> None:
        day = day_of(row[self.date_column])
        buffer = self._buffers.get(day)
        if buffer is None:
            if day in self.keep_existing and self._path(day).exists():
                self._buffers[day] = buffer = _Discard()
                self.kept.add(day)
            else:
                self._buffers[day] = buffer = []
        buffer.append(row)
        if len(buffer) >= ROW_GROUP_ROWS:
            self._flush(day)

    def add_all(self, rows: Iterable[dict[str, Any]]) -> None:
        for row in rows:
            self.add(row)

    def _flush(self, day: str) -> None:
        rows = self._buffers[day]
        if isinstance(rows, _Discard) or not rows:
            return
        writer = self._writers.get(day)
        if writer is None:
            path = self._path(day)
            path.parent.mkdir(parents=True, exist_ok=True)
            writer = self._writers[day] = pq.ParquetWriter(_tmp(path), self.schema, compression=COMPRESSION)
        writer.write_table(_table(self.schema, rows))
        self.rows[day] = self.rows.get(day, 0) + len(rows)
        rows.clear()

    def commit(self) -> dict[str, int]:
        """Write what is left and put every day's file in place; the rows written per day."""
        for day in list(self._buffers):
            self._flush(day)
        for day, writer in self._writers.items():
            writer.close()
            replace_durably(_tmp(self._path(day)), self._path(day))
        self._writers.clear()
        return dict(sorted(self.rows.items()))

    def abort(self) -> None:
        for day, writer in self._writers.items():
            writer.close()
            _tmp(self._path(day)).unlink(missing_ok=True)
        self._writers.clear()


class _Discard(list):
    """Rows of a day left as an earlier export wrote it."""

    def append(self, row: dict[str, Any]) -> None:
        pass


def _table(schema: pa.Schema, rows: list[dict[str, Any]]) -> pa.Table:
    return pa.Table.from_pydict({name: [row[name] for row in rows] for name in schema.names}, schema=schema)


def write_file(path: Path, table: str, rows: list[dict[str, Any]]) -> None:
    """`rows` as the Parquet file `path`, replacing it at once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(_table(t.SCHEMAS[table], rows), _tmp(path), compression=COMPRESSION)
    replace_durably(_tmp(path), path)


def read_file(path: Path) -> list[dict[str, Any]]:
    """The rows of a ledger file, times as ms (as they were written); [] if there is none."""
    if not path.exists():
        return []
    data = pq.read_table(path)
    for i, column in enumerate(data.schema):
        if pa.types.is_timestamp(column.type):
            data = data.set_column(i, column.name, data.column(i).cast(pa.int64()))
    return data.to_pylist()
