# cython: language_level=3, boundscheck=False, wraparound=False
"""The check of a BROKER_SEND's messages compiled for the request most sends are (qmq/broker/sending.py):
every message a map of a subject already found valid, an id of 1 to `max_id_len` bytes, a bytes
payload of at most `max_payload` bytes, a key of at most `max_key_len` bytes or none, no tags and no
`once` mark. `plain_batch` answers the store's messages for such a request, the same as
`validate_sent_message` makes them one by one, or None for any other request: the Python loop then
checks it message by message and says what is wrong with which.
"""

from cpython.bytes cimport PyBytes_GET_SIZE
from cpython.dict cimport PyDict_GetItem, PyDict_Size
from cpython.object cimport PyObject
from cpython.unicode cimport PyUnicode_AsUTF8AndSize


cdef inline object _get(dict item, str name):
    cdef PyObject* value = PyDict_GetItem(item, name)
    return None if value is NULL else <object>value


def plain_batch(list items not None, set known_subjects not None, Py_ssize_t max_payload, Py_ssize_t max_id_len,
                Py_ssize_t max_key_len, message_type):
    """`[message_type(subject, id, payload, key or None, (), 0), ...]` for `items`, or None."""
    cdef list batch = []
    cdef Py_ssize_t n, fields
    cdef object subject, message_id, payload, key, tags
    new = tuple.__new__
    empty = ()
    for item in items:
        if type(item) is not dict:
            return None
        subject = _get(<dict>item, "subject")
        message_id = _get(<dict>item, "id")
        payload = _get(<dict>item, "payload")
        if type(subject) is not str or type(message_id) is not str or type(payload) is not bytes:
            return None
        if subject not in known_subjects or PyBytes_GET_SIZE(payload) > max_payload:
            return None
        fields = 3
        key = _get(<dict>item, "key")
        tags = _get(<dict>item, "tags")
        try:
            PyUnicode_AsUTF8AndSize(message_id, &n)
            if not 0 < n <= max_id_len:
                return None
            if key is not None:
                fields += 1
                if type(key) is not str:
                    return None
                PyUnicode_AsUTF8AndSize(key, &n)
                if n > max_key_len:
                    return None
        except UnicodeError:
            return None
        if tags is not None:
            fields += 1
            if tags:
                return None
        if PyDict_Size(item) != fields:  # another field: a `once` mark, or one this loop does not know
            return None
        batch.append(new(message_type, (subject, message_id, payload, key or None, empty, 0)))
    return batch
