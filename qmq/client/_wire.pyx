# cython: language_level=3, boundscheck=False, wraparound=False
"""`OutgoingMessage.to_wire` compiled for the messages most sends carry (qmq/client/messages.py):
a bytes body, or bytes of a given content type (an outbox row); no order key; str headers or none;
no tags; a subject already found valid in this process. `plain_wire` builds the same envelope bytes
as `qmq.protocol.envelope.encode` (msgpack, byte for byte) and the same wire map, and accepts only what
the broker's check (`validate_sent_message`) would accept. Anything else, including anything it
would refuse, is answered None: the Python path then builds the message, and raises the error a
broker would answer. A client makes one per message sent: this is most of its own time per message.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.dict cimport PyDict_GetItem, PyDict_Size
from cpython.object cimport PyObject
from cpython.unicode cimport PyUnicode_AsUTF8AndSize
from libc.stdint cimport uint8_t, uint64_t
from libc.string cimport memcpy

cdef bytes MARKER = b"qmq1"
cdef str BYTES_TYPE = "application/octet-stream"


cdef inline Py_ssize_t _str_head(Py_ssize_t n) noexcept:
    return 1 if n < 32 else (2 if n < 256 else (3 if n < 65536 else 5))


cdef inline Py_ssize_t _bin_head(Py_ssize_t n) noexcept:
    return 2 if n < 256 else (3 if n < 65536 else 5)


cdef inline uint8_t* _put_be(uint8_t* out, uint64_t value, int width) noexcept:
    cdef int i
    for i in range(width):
        out[i] = <uint8_t>(value >> (8 * (width - 1 - i)))
    return out + width


cdef inline uint8_t* _put_sized(uint8_t* out, const char* data, Py_ssize_t n, uint8_t code8, uint8_t code16,
                               uint8_t code32) noexcept:
    """A msgpack str or bin of 8-, 16- or 32-bit length (the codes of its kind), then its bytes."""
    if n < 256:
        out[0] = code8
        out = _put_be(out + 1, n, 1)
    elif n < 65536:
        out[0] = code16
        out = _put_be(out + 1, n, 2)
    else:
        out[0] = code32
        out = _put_be(out + 1, n, 4)
    memcpy(out, data, n)
    return out + n


cdef inline uint8_t* _put_str(uint8_t* out, const char* data, Py_ssize_t n) noexcept:
    if n >= 32:
        return _put_sized(out, data, n, 0xD9, 0xDA, 0xDB)
    out[0] = 0xA0 | <uint8_t>n  # fixstr
    memcpy(out + 1, data, n)
    return out + 1 + n


cdef inline uint8_t* _put_bin(uint8_t* out, const char* data, Py_ssize_t n) noexcept:
    return _put_sized(out, data, n, 0xC4, 0xC5, 0xC6)


cdef inline Py_ssize_t _uint_size(uint64_t value) noexcept:
    if value < 128:
        return 1
    if value < 256:
        return 2
    if value < 65536:
        return 3
    if value < 4294967296:
        return 5
    return 9


cdef inline uint8_t* _put_uint(uint8_t* out, uint64_t value) noexcept:
    if value < 128:
        out[0] = <uint8_t>value
        return out + 1
    if value < 256:
        out[0] = 0xCC
        return _put_be(out + 1, value, 1)
    if value < 65536:
        out[0] = 0xCD
        return _put_be(out + 1, value, 2)
    if value < 4294967296:
        out[0] = 0xCE
        return _put_be(out + 1, value, 4)
    out[0] = 0xCF
    return _put_be(out + 1, value, 8)


cdef inline object _get(dict fields, str name):
    cdef PyObject* value = PyDict_GetItem(fields, name)
    return None if value is NULL else <object>value


def plain_wire(dict fields not None, set known_subjects not None, Py_ssize_t max_payload, Py_ssize_t max_id_len,
               Py_ssize_t max_key_len):
    """The wire map of the message whose fields are `fields` (an `OutgoingMessage`'s instance dict),
    or None when it is not of the kind described above or the broker would refuse it."""
    cdef object subject = _get(fields, "subject")
    if type(subject) is not str or subject not in known_subjects:
        return None
    if _get(fields, "order_key") is not None or _get(fields, "tags"):
        return None
    cdef object message_id = _get(fields, "id")
    cdef object key = _get(fields, "key")
    cdef object body = _get(fields, "body")
    cdef object content_type = _get(fields, "content_type")
    cdef object created_at = _get(fields, "created_at")
    cdef object headers = _get(fields, "headers")
    cdef Py_ssize_t n, ct_len, body_len, size, header_count = 0
    cdef const char* ct_data
    cdef const char* text
    cdef uint64_t created
    if type(message_id) is not str:
        return None
    try:
        PyUnicode_AsUTF8AndSize(message_id, &n)
        if not 0 < n <= max_id_len:
            return None
        if key is not None:
            if type(key) is not str:  # the type first: a comparison could run a user's code
                return None
            PyUnicode_AsUTF8AndSize(key, &n)
            if n > max_key_len:
                return None
    except UnicodeError:
        return None
    if type(body) is not bytes or type(created_at) is not int or created_at < 0 or created_at >= 2 ** 64:
        return None
    created = created_at
    if content_type is None:
        content_type = BYTES_TYPE
    elif type(content_type) is not str:
        return None
    cdef list pairs = None  # the headers' (name, value), made only for a message that has some
    if headers is not None:
        if type(headers) is not dict:
            return None
        header_count = PyDict_Size(headers)
        if header_count >= 16:
            return None
        pairs = []
        for name, value in (<dict>headers).items():
            if type(name) is not str or type(value) is not str:
                return None
            pairs.append((name, value))
    try:
        ct_data = PyUnicode_AsUTF8AndSize(content_type, &ct_len)
        body_len = PyBytes_GET_SIZE(body)
        # {"v": "qmq1", "b": body, "ct": content_type, "t": created_at[, "h": {...}]}
        size = 1 + 2 + 5 + 2 + _bin_head(body_len) + body_len + 3 + _str_head(ct_len) + ct_len + 2
        size += _uint_size(created)
        if header_count:
            size += 2 + 1
            for name, value in pairs:
                PyUnicode_AsUTF8AndSize(name, &n)
                size += _str_head(n) + n
                PyUnicode_AsUTF8AndSize(value, &n)
                size += _str_head(n) + n
    except UnicodeError:
        return None
    if size > max_payload:
        return None
    payload = PyBytes_FromStringAndSize(NULL, size)
    cdef uint8_t* out = <uint8_t*>PyBytes_AS_STRING(payload)
    out[0] = 0x85 if header_count else 0x84
    out = _put_str(out + 1, b"v", 1)
    out = _put_str(out, PyBytes_AS_STRING(MARKER), 4)
    out = _put_str(out, b"b", 1)
    out = _put_bin(out, PyBytes_AS_STRING(body), body_len)
    out = _put_str(out, b"ct", 2)
    out = _put_str(out, ct_data, ct_len)
    out = _put_str(out, b"t", 1)
    out = _put_uint(out, created)
    if header_count:
        out = _put_str(out, b"h", 1)
        out[0] = 0x80 | <uint8_t>header_count
        out += 1
        for name, value in pairs:
            text = PyUnicode_AsUTF8AndSize(name, &n)
            out = _put_str(out, text, n)
            text = PyUnicode_AsUTF8AndSize(value, &n)
            out = _put_str(out, text, n)
    if key:
        return {"id": message_id, "subject": subject, "payload": payload, "key": key}
    return {"id": message_id, "subject": subject, "payload": payload}
