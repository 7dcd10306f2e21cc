"""The record codec: round trips, and any bytes decode to a record or a RecordError, nothing else."""

import contextlib
import json
import subprocess
import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from qmq.store import record as rec
from qmq.store.store import LogStore, Message
from tests.support.stores import SMALL

texts = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789.-_", min_size=1, max_size=30)


@given(
    subject=texts,
    message_id=texts,
    key=st.none() | texts,
    tags=st.lists(texts, max_size=4),
    payload=st.binary(max_size=2000),
    seq=st.integers(0, 2**63 - 1),
    flags=st.integers(0, 255),
)
def test_round_trip(subject, message_id, key, tags, payload, seq, flags):
    data = rec.encode(
        rec.Attr.MESSAGE,
        flags,
        1234,
        seq,
        subject.encode(),
        message_id.encode(),
        (key or "").encode(),
        ",".join(tags).encode(),
        payload,
    )
    r = rec.decode(b"xx" + data, 2, 100)
    assert (r.offset, r.size, r.subject, r.message_id, r.key, r.tags, r.payload, r.seq, r.flags) == (
        102,
        len(data),
        subject,
        message_id,
        key,
        tuple(tags),
        payload,
        seq,
        flags,
    )


@settings(max_examples=3000, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_never_raise_anything_but_record_error(data):
    with contextlib.suppress(rec.RecordError):
        rec.decode(data, 0, 0)


VALID = rec.encode(rec.Attr.MESSAGE, 0, 1, 2, b"subject", b"id-1", b"key", b"a,b", b"payload" * 10)


@settings(max_examples=3000, deadline=None)
@given(st.integers(0, len(VALID) - 1), st.integers(1, 255), st.integers(0, len(VALID)))
def test_every_flipped_byte_or_cut_is_detected(position, xor, cut):
    flipped = bytearray(VALID)
    flipped[position] ^= xor
    for damaged in (bytes(flipped), VALID[:cut] if cut < len(VALID) else VALID[:-1]):
        try:
            rec.decode(damaged, 0, 0)
        except rec.RecordError:
            continue
        raise AssertionError(f"damage not detected: flip at {position}, cut at {cut}")


def test_find_next_valid_skips_damage():
    buf = bytearray(VALID * 3)
    buf[len(VALID) + 5] ^= 0xFF
    assert rec.find_next_valid(bytes(buf), len(VALID), 0) == 2 * len(VALID)
    assert rec.find_next_valid(bytes(buf), 2 * len(VALID), 0) is None


def test_log_dump_prints_json_lines(tmp_path):
    with LogStore(tmp_path, SMALL) as store:
        store.append(
            [
                Message("a", "1", b"hello", tags=("t",)),
                Message("b", "2", b"\xff\x00"),
                Message("a", "3", b"again", key="k"),
            ]
        )
    out = subprocess.run(
        [sys.executable, "-m", "qmq", "log", "dump", "--data-dir", str(tmp_path), "--subject", "a"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rows = [json.loads(line) for line in out.splitlines()]
    assert [(r["message_id"], r["payload"], r["seq"], r["key"], r["tags"]) for r in rows] == [
        ("1", "hello", 0, None, ["t"]),
        ("3", "again", 1, "k", []),
    ]
    out = subprocess.run(
        [sys.executable, "-m", "qmq", "log", "dump", "--data-dir", str(tmp_path), "--subject", "b"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert json.loads(out)["payload_base64"] == "/wA="


def test_log_commands_name_a_directory_that_is_not_a_store(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "qmq", "log", "verify", "--data-dir", str(tmp_path)], capture_output=True, text=True
    )
    assert result.returncode == 2 and "not a qmq store" in result.stderr


@given(data=st.binary(max_size=5000), prefix=st.binary(max_size=100), cut=st.integers(0, 64))
def test_checksums_are_zlibs(data, prefix, cut):
    """The store's checksums (zlib-ng) give zlib's values, on bytes and on views, continued from a
    prefix's value as `record.key_hash` does: logs and indexes written before the change, or by
    another build, read the same."""
    import zlib

    from qmq.store import checksum

    view = memoryview(data)[cut:]
    assert checksum.crc32(data) == zlib.crc32(data)
    assert checksum.crc32(view, zlib.crc32(prefix)) == zlib.crc32(view, zlib.crc32(prefix))
    assert checksum.adler32(data) == zlib.adler32(data)
    assert checksum.adler32(view, zlib.adler32(prefix)) == zlib.adler32(view, zlib.adler32(prefix))
    assert rec.key_hash(data, prefix) == (zlib.crc32(data, zlib.crc32(prefix)) << 32) | zlib.adler32(
        data, zlib.adler32(prefix)
    )
