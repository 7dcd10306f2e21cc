# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False, cdivision=True
"""Compiled versions of three of the log store's per-record loops (qmq/store/speedups.py says when
they are used). Each does exactly what its Python original does, byte for byte:

- `check_records` is `replication.check_chunk_py` without the error messages: a replica's check and
  derivation of every record it is sent;
- `index_add` is the loop of `index.IndexFile.add`: every append, on masters and replicas;
- `encode_batch` is the loop of `store.LogStore._encode_py`: a master's records and their entries.

A record's CRC still comes from zlib-ng (passed in: it folds with the CPU's carry-less multiply);
the short fields' hashes (ids, keys, tags) come from zlib's C functions, whose values are the same,
without a Python call each. tests/test_store_speedups.py holds both versions to the same answers.
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from cpython.unicode cimport PyUnicode_DecodeUTF8
from libc.string cimport memcpy
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t


cdef extern from "zlib.h" nogil:
    unsigned long zlib_crc32 "crc32"(unsigned long crc, const unsigned char* buf, unsigned int length)
    unsigned long zlib_adler32 "adler32"(unsigned long adler, const unsigned char* buf, unsigned int length)

# The record header (qmq/store/record.py HEADER, ">IIIBBQQHBHHI") and the consume-log entry
# (qmq/store/consume_log.py ENTRY, ">HBBIQQQ"): big-endian, as the files hold them.
cdef enum:
    HEADER_SIZE = 41
    CRC_START = 12
    CL_ENTRY_SIZE = 32
    CL_ENTRY_MAGIC = 0xC10C
    TAG_SEPARATOR = 44  # ","
    # the key index (qmq/store/index.py): header, slots of ">I", entries of ">QQI"
    INDEX_HEADER_SIZE = 64
    SLOT_SIZE = 4
    INDEX_ENTRY_SIZE = 20


cdef inline uint16_t _be16(const uint8_t* p) noexcept nogil:
    return (<uint16_t>p[0] << 8) | p[1]


cdef inline uint32_t _be32(const uint8_t* p) noexcept nogil:
    return (<uint32_t>p[0] << 24) | (<uint32_t>p[1] << 16) | (<uint32_t>p[2] << 8) | p[3]


cdef inline uint64_t _be64(const uint8_t* p) noexcept nogil:
    return (<uint64_t>_be32(p) << 32) | _be32(p + 4)


cdef inline void _put32(uint8_t* p, uint32_t v) noexcept nogil:
    p[0] = v >> 24
    p[1] = v >> 16
    p[2] = v >> 8
    p[3] = v


cdef inline void _put64(uint8_t* p, uint64_t v) noexcept nogil:
    _put32(p, v >> 32)
    _put32(p + 4, <uint32_t>v)


cdef inline bint _ascii(const uint8_t* p, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(n):
        if p[i] & 0x80:
            return False
    return True


cdef bint _utf8(const uint8_t* p, Py_ssize_t n):
    """`p[:n]` is valid UTF-8."""
    if _ascii(p, n):
        return True
    try:
        PyUnicode_DecodeUTF8(<const char*>p, n, NULL)
    except UnicodeDecodeError:
        return False
    return True


cdef inline uint64_t _key_hash(const uint8_t* prefix, Py_ssize_t prefix_len, const uint8_t* p, Py_ssize_t n) noexcept nogil:
    """`record.key_hash(p[:n], prefix)`."""
    cdef unsigned long crc = zlib_crc32(0, prefix, prefix_len)
    cdef unsigned long adler = zlib_adler32(1, prefix, prefix_len)
    return (<uint64_t>zlib_crc32(crc, p, n) << 32) | <uint64_t>zlib_adler32(adler, p, n)


cdef inline uint64_t _tag_mask(const uint8_t* p, Py_ssize_t n) noexcept nogil:
    """`record.tag_mask` of the tags `p[:n]` joined by TAG_SEPARATOR (n > 0)."""
    cdef uint64_t mask = 0
    cdef uint32_t h
    cdef Py_ssize_t i, start = 0
    for i in range(n + 1):
        if i == n or p[i] == TAG_SEPARATOR:
            h = zlib_crc32(0, p + start, i - start)
            mask |= (<uint64_t>1 << (h & 63)) | (<uint64_t>1 << ((h >> 6) & 63))
            start = i + 1
    return mask


def check_records(bytes data, Py_ssize_t offset, uint32_t magic_ok, Py_ssize_t max_size, int message, int blank,
                  crc32):
    """(sizes, runs, index pairs, blanks, bad): as `check_chunk_py` derives them, with `bad` the chunk
    position of the first record that fails a check (-1: none; the rest is then not to be used)."""
    cdef const uint8_t* buf = data
    cdef Py_ssize_t total = len(data)
    cdef Py_ssize_t position = 0, end, p, at
    cdef uint32_t size, crc
    cdef uint8_t attr
    cdef uint64_t ts, seq, h
    cdef uint16_t s_len, k_len, t_len
    cdef uint8_t i_len
    cdef uint32_t p_len
    cdef uint8_t entry[CL_ENTRY_SIZE]
    cdef uint64_t mask
    cdef list sizes = [], runs = [], pairs = [], blanks = []
    cdef dict open_runs = {}
    cdef list run
    cdef object view = memoryview(data)
    cdef bytes subject
    while position < total:
        at = offset + position
        if total - position < HEADER_SIZE:
            return sizes, runs, pairs, blanks, position
        size = _be32(buf + position)
        end = position + size
        if (
            _be32(buf + position + 4) != magic_ok
            or size < HEADER_SIZE
            or size > max_size
            or end > total
        ):
            return sizes, runs, pairs, blanks, position
        crc = _be32(buf + position + 8)
        attr = buf[position + 12]
        ts = _be64(buf + position + 14)
        seq = _be64(buf + position + 22)
        s_len = _be16(buf + position + 30)
        i_len = buf[position + 32]
        k_len = _be16(buf + position + 33)
        t_len = _be16(buf + position + 35)
        p_len = _be32(buf + position + 37)
        if (
            <uint64_t>HEADER_SIZE + s_len + i_len + k_len + t_len + p_len != size
            or crc32(view[position + CRC_START : end]) != crc
            or (attr != message and attr != blank)
        ):
            return sizes, runs, pairs, blanks, position
        sizes.append(size)
        if attr == blank:
            blanks.append(position)
            position = end
            continue
        p = position + HEADER_SIZE  # subject, message id, key, tags, payload
        if not (  # text fields are UTF-8, as `record.decode` checks
            _utf8(buf + p + s_len, i_len)
            and _utf8(buf + p + s_len + i_len, k_len)
            and _utf8(buf + p + s_len + i_len + k_len, t_len)
        ):
            return sizes, runs, pairs, blanks, position
        subject = PyBytes_FromStringAndSize(<const char*>buf + p, s_len)
        mask = _tag_mask(buf + p + s_len + i_len + k_len, t_len) if t_len else 0
        pairs.append((_key_hash(buf, 0, buf + p + s_len, i_len), at))
        if k_len:
            pairs.append((_key_hash(buf + p, s_len, buf + p + s_len + i_len, k_len), at))
        position = end
        entry[0] = CL_ENTRY_MAGIC >> 8
        entry[1] = CL_ENTRY_MAGIC & 0xFF
        entry[2] = 0
        entry[3] = 0
        _put32(entry + 4, size)
        _put64(entry + 8, <uint64_t>at)
        _put64(entry + 16, mask)
        _put64(entry + 24, ts)
        run = open_runs.get(subject)
        if run is not None and <uint64_t>run[0] + len(run[1]) != seq:  # not the next of its run (never, from a master)
            runs.append((subject, run[0], b"".join(run[1])))
            run = None
        if run is None:
            run = [seq, []]
            open_runs[subject] = run
        (<list>run[1]).append(PyBytes_FromStringAndSize(<const char*>entry, CL_ENTRY_SIZE))
    for subject, run in open_runs.items():
        runs.append((subject, run[0], b"".join(run[1])))
    return sizes, runs, pairs, blanks, -1


def index_add(mm, Py_ssize_t slots, Py_ssize_t entries_at, Py_ssize_t count, list taken):
    """Chain each (hash, offset) of `taken` into the index file mapped at `mm`, which holds `count`
    entries; returns the new count. The caller has reserved the space and writes the header."""
    cdef uint8_t[::1] buf = mm
    cdef uint8_t* base = &buf[0]
    cdef Py_ssize_t n = count, slot_at, entry_at
    cdef uint64_t h, offset
    cdef uint32_t prev
    if (
        slots <= 0
        or entries_at < INDEX_HEADER_SIZE + slots * SLOT_SIZE
        or entries_at + (count + len(taken)) * INDEX_ENTRY_SIZE > buf.shape[0]
    ):  # a header that does not fit its file: damage, where the Python loop would raise too
        raise ValueError(f"key-index file of {buf.shape[0]} bytes cannot hold {count + len(taken)} entries")
    for pair in taken:
        h = pair[0]
        offset = pair[1]
        slot_at = INDEX_HEADER_SIZE + <Py_ssize_t>((h >> 32) % <uint64_t>slots) * SLOT_SIZE
        prev = _be32(base + slot_at)
        entry_at = entries_at + n * INDEX_ENTRY_SIZE
        _put64(base + entry_at, h)
        _put64(base + entry_at + 8, offset)
        _put32(base + entry_at + 16, prev)
        n += 1
        _put32(base + slot_at, <uint32_t>n)
    return n


def encode_batch(messages, dict subject_bytes, new_subject, dict next_seq, Py_ssize_t position, uint64_t now,
                 uint32_t magic, Py_ssize_t max_id_len, Py_ssize_t max_key_len, encode_tags, crc32, appended,
                 store_error):
    """`LogStore.append`'s pass over a batch, as `LogStore._encode_py` makes it: (records, results,
    runs, index pairs, end), plus the subjects' next sequences, which the caller applies only once the
    batch is stored (`next_seq` itself is not changed here). Raises `store_error` for an id or key
    out of bounds, as the Python loop does."""
    cdef list encoded = [], results = [], pairs = []
    cdef dict runs = {}, seqs = {}
    cdef bytes subject_b, message_id, key, tags_b, record
    cdef Py_buffer payload
    cdef Py_ssize_t s_len, i_len, k_len, t_len, p_len, size, meta_len
    cdef uint64_t seq, mask
    cdef uint8_t* out
    cdef unsigned long crc
    cdef uint8_t entry[CL_ENTRY_SIZE]
    cdef list run
    cdef object flags, payload_obj
    for m in messages:
        subject = m.subject
        subject_b = subject_bytes.get(subject) or new_subject(subject)
        message_id = m.message_id.encode()
        key = m.key.encode() if m.key else b""
        if not 0 < len(message_id) <= max_id_len or len(key) > max_key_len:
            raise store_error(
                f"message id must be 1-{max_id_len} bytes and key at most {max_key_len} bytes "
                f"(message id {m.message_id!r})"
            )
        seq = seqs[subject] if subject in seqs else next_seq.get(subject, 0)
        seqs[subject] = seq + 1
        run = runs.get(subject)
        if run is None:
            run = [seq, []]
            runs[subject] = run
        tags = m.tags
        tags_b = encode_tags(tags) if tags else b""
        payload_obj = m.payload
        flags = m.flags
        PyObject_GetBuffer(payload_obj, &payload, PyBUF_SIMPLE)  # bytes, or a view of a request's frame
        p_len = payload.len
        s_len, i_len, k_len, t_len = len(subject_b), len(message_id), len(key), len(tags_b)
        if not (0 <= flags <= 0xFF and s_len <= 0xFFFF and k_len <= 0xFFFF and t_len <= 0xFFFF
                and i_len <= 0xFF and p_len <= 0xFFFFFFFF):
            PyBuffer_Release(&payload)
            raise OverflowError(f"a field does not fit its record header (message id {m.message_id!r})")
        meta_len = HEADER_SIZE - CRC_START + s_len + i_len + k_len + t_len
        size = CRC_START + meta_len + p_len
        record = PyBytes_FromStringAndSize(NULL, size)
        out = <uint8_t*>PyBytes_AS_STRING(record)
        _put32(out, <uint32_t>size)
        _put32(out + 4, magic)
        out[12] = 0  # Attr.MESSAGE
        out[13] = <uint8_t>flags
        _put64(out + 14, now)
        _put64(out + 22, seq)
        out[30] = s_len >> 8
        out[31] = s_len & 0xFF
        out[32] = <uint8_t>i_len
        out[33] = k_len >> 8
        out[34] = k_len & 0xFF
        out[35] = t_len >> 8
        out[36] = t_len & 0xFF
        _put32(out + 37, <uint32_t>p_len)
        out += HEADER_SIZE
        memcpy(out, <const char*>subject_b, s_len)
        memcpy(out + s_len, <const char*>message_id, i_len)
        memcpy(out + s_len + i_len, <const char*>key, k_len)
        memcpy(out + s_len + i_len + k_len, <const char*>tags_b, t_len)
        memcpy(out + s_len + i_len + k_len + t_len, payload.buf, p_len)
        PyBuffer_Release(&payload)
        out -= HEADER_SIZE
        # the meta part's CRC here, the payload's by zlib-ng from it: `record.encode`'s value
        crc = zlib_crc32(0, out + CRC_START, meta_len)
        crc = crc32(payload_obj, crc)  # one call: a Cython memoryview slice of the record costs more
        _put32(out + 8, <uint32_t>crc)
        encoded.append(record)
        results.append(tuple.__new__(appended, (position, seq, position + size)))
        mask = _tag_mask(<const uint8_t*><const char*>tags_b, t_len) if t_len else 0
        entry[0] = CL_ENTRY_MAGIC >> 8
        entry[1] = CL_ENTRY_MAGIC & 0xFF
        entry[2] = 0
        entry[3] = 0
        _put32(entry + 4, <uint32_t>size)
        _put64(entry + 8, <uint64_t>position)
        _put64(entry + 16, mask)
        _put64(entry + 24, now)
        (<list>run[1]).append(PyBytes_FromStringAndSize(<const char*>entry, CL_ENTRY_SIZE))
        pairs.append((_key_hash(out, 0, <const uint8_t*><const char*>message_id, i_len), position))
        if k_len:
            pairs.append((_key_hash(<const uint8_t*><const char*>subject_b, s_len,
                                    <const uint8_t*><const char*>key, k_len), position))
        position += size
    return encoded, results, {subject: (run[0], run[1]) for subject, run in runs.items()}, pairs, position, seqs
