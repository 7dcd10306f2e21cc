"""The compiled store loops (qmq/store/_speedups.pyx) against their Python originals: the same
answers for any chunk of records, whole or damaged, the same key-index bytes, the same records and
entries for any batch a master appends."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qmq.protocol.errors import ProtocolError
from qmq.protocol.limits import MAX_KEY_LEN, MAX_MESSAGE_ID_LEN
from qmq.store import record as rec
from qmq.store import speedups
from qmq.store.index import IndexFile
from qmq.store.replication import ChunkError, check_chunk, check_chunk_py
from qmq.store.store import LogStore, Message, StoreError
from tests.support.stores import SMALL

text = st.text(st.characters(blacklist_categories=["Cs"], blacklist_characters=","), max_size=12)
records = st.lists(
    st.one_of(
        st.tuples(
            st.sampled_from([b"a", b"order.created", "é.subject".encode()]),
            text.map(str.encode),  # message id (may be empty, may be non-ASCII)
            text.map(str.encode),  # key (empty: none)
            st.lists(text, max_size=3).map(lambda tags: ",".join(tags).encode()),
            st.binary(max_size=300),
            st.integers(0, 1 << 40),  # seq: runs of a subject break where seqs jump
        ),
        st.integers(rec.HEADER_SIZE, 200),  # a blank record of this size
    ),
    min_size=1,
    max_size=12,
)


def encode_all(items) -> bytes:
    out = []
    for item in items:
        if isinstance(item, int):
            out.append(rec.encode_blank(item))
        else:
            subject, message_id, key, tags, payload, seq = item
            ts = 1_700_000_000_000 + seq
            out.append(rec.encode(rec.Attr.MESSAGE, 0, ts, seq, subject, message_id, key, tags, payload))
    return b"".join(out)


def outcome(check, data: bytes, offset: int):
    try:
        return check(data, offset)
    except ChunkError as exc:
        return ("ChunkError", str(exc), exc.offset)


def test_the_compiled_loops_are_built() -> None:
    # scripts/setup.sh builds them (Cython, gcc, zlib's headers); without them the tests below would
    # hold the Python loops to themselves
    assert speedups.COMPILED, speedups.describe()


@settings(max_examples=300, deadline=None)
@given(records, st.integers(0, 1 << 40))
def test_a_whole_chunk_checks_the_same(items, offset) -> None:
    data = encode_all(items)
    assert check_chunk(data, offset) == check_chunk_py(data, offset)


@settings(max_examples=300, deadline=None)
@given(records, st.data())
def test_a_damaged_chunk_fails_the_same(items, data) -> None:
    chunk = bytearray(encode_all(items))
    flipped = data.draw(st.booleans())
    if flipped:  # a CRC-32 catches every one-byte change
        position = data.draw(st.integers(0, len(chunk) - 1))
        chunk[position] ^= data.draw(st.integers(1, 255))
    else:  # a cut between two records leaves a whole, shorter chunk
        del chunk[data.draw(st.integers(1, len(chunk) - 1)) :]
    got = outcome(check_chunk, bytes(chunk), 1000)
    assert got == outcome(check_chunk_py, bytes(chunk), 1000)
    assert got[0] == "ChunkError" or not flipped


@pytest.mark.parametrize("field", ["message_id", "key", "tags"])
def test_text_that_is_not_utf8_fails_the_same_with_a_good_crc(field) -> None:
    fields = {"message_id": b"id", "key": b"k", "tags": b"t1"}
    fields[field] = b"ok\xff"
    good = rec.encode(rec.Attr.MESSAGE, 0, 1, 0, b"s", b"first", b"", b"", b"x")
    bad = rec.encode(rec.Attr.MESSAGE, 0, 1, 1, b"s", fields["message_id"], fields["key"], fields["tags"], b"y")
    got = outcome(check_chunk, good + bad, 0)
    assert got == outcome(check_chunk_py, good + bad, 0)
    assert got[0] == "ChunkError" and got[2] == len(good)


def index_file(tmp_path, name: str) -> IndexFile:
    return IndexFile(tmp_path / name, 0, slots=64, capacity=4096, create=True)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.lists(st.integers(0, (1 << 64) - 1), max_size=40), max_size=6))
def test_the_key_index_is_written_byte_for_byte_the_same(tmp_path_factory, batches) -> None:
    tmp_path = tmp_path_factory.mktemp("index")
    compiled, python = index_file(tmp_path, "compiled"), index_file(tmp_path, "python")
    offset = 0
    try:
        for hashes in batches:  # few slots: long chains, shared buckets within a batch
            pairs = [(h, offset + i) for i, h in enumerate(hashes)]
            offset += len(pairs)
            compiled.add(pairs, 0)
            speedups.compiled, saved = None, speedups.compiled
            try:
                python.add(pairs, 0)
            finally:
                speedups.compiled = saved
        assert compiled.mm[:] == python.mm[:]
        for hashes in batches:
            for h in hashes:
                assert compiled.find(h) == python.find(h) != []
    finally:
        compiled.close()
        python.close()


def test_a_key_index_header_bigger_than_its_file_is_an_error_not_a_crash(tmp_path) -> None:
    index = index_file(tmp_path, "small")
    try:
        with pytest.raises(ValueError, match="cannot hold"):
            speedups.compiled.index_add(index.mm, index.slots, index.entries_at, index.capacity, [(1, 2)])
        with pytest.raises(ValueError, match="cannot hold"):
            speedups.compiled.index_add(index.mm, 1 << 30, index.entries_at, 0, [(1, 2)])
    finally:
        index.close()


def test_the_pure_python_loops_can_be_chosen_and_say_so() -> None:
    code = "from qmq.store import speedups; print(speedups.COMPILED, speedups.describe())"
    env = {**os.environ, speedups.PURE_PYTHON_ENV: "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.startswith("False pure-Python store loops (QMQ_PURE_PYTHON is set)")


tag = st.text("abcXYZ019._-:", min_size=1, max_size=8)
messages = st.lists(
    st.builds(
        Message,
        subject=st.sampled_from(["a", "order.created", "é.subject"]),
        message_id=text.filter(lambda t: 0 < len(t.encode()) <= MAX_MESSAGE_ID_LEN),
        payload=st.binary(max_size=300).flatmap(lambda b: st.sampled_from([b, bytearray(b), memoryview(b)])),
        key=st.one_of(st.none(), text),
        tags=st.lists(tag, max_size=3).map(tuple),
        flags=st.integers(0, 255),
    ),
    min_size=1,
    max_size=10,
)


def encoded_by(store: LogStore, encode, batch: list[Message]):
    try:
        out = encode(batch, 1_700_000_000_123)
    except (StoreError, ProtocolError) as exc:
        out = (type(exc).__name__, str(exc))
    return out, dict(store._next_seq)


@settings(max_examples=100, deadline=None)
@given(st.lists(messages, min_size=1, max_size=3), st.sampled_from([None, "", "x" * (MAX_KEY_LEN + 1), "bad subject"]))
def test_a_batch_is_encoded_the_same(tmp_path_factory, batches, spoiler) -> None:
    config = SMALL  # small files: a store opened per example; segments and index files roll
    path = tmp_path_factory.mktemp("stores")
    with LogStore(path / "c", config) as compiled, LogStore(path / "p", config) as python:
        for n, batch in enumerate(batches):
            if spoiler is not None and n == len(batches) - 1:  # the last batch refused whole
                m = batch[-1]
                batch[-1] = (
                    m._replace(subject="")
                    if spoiler == "bad subject"
                    else m._replace(message_id=spoiler)
                    if spoiler == ""
                    else m._replace(key=spoiler)
                )
            got = encoded_by(compiled, compiled._encode, batch)
            assert got == encoded_by(python, python._encode_py, batch)
            if isinstance(got[0][0], str):
                assert got[0][0] in ("StoreError", "ProtocolError")
                continue
            compiled.append(batch)  # stored, so the next batch starts where this one ended
            python.append(batch)


def test_an_id_longer_than_its_header_field_is_refused_by_both(tmp_path) -> None:
    with LogStore(tmp_path, SMALL) as store:
        batch = [Message("s", "a", b"x"), Message("s", "é" * 200, b"y")]
        for encode in (store._encode, store._encode_py):
            with pytest.raises(StoreError, match="message id must be"):
                encode(batch, 1)
            assert store._next_seq == {}
