"""The ACL check of per-application credentials, without I/O: ordered subjects' queues (`subject#7`)
and retry subjects are judged by the subject the application named, and an ordered consumer's queue
leases are consuming like pulls."""

import pytest

from qmq.net.acl import Principal, authorize
from qmq.protocol.codes import RequestCode
from qmq.protocol.errors import ErrorCode, ProtocolError

BILLING = Principal("c1", "billing", produce=("order.events",), consume=("order.events:ledger",))


def test_an_ordered_subjects_queues_are_the_subject_for_producing():
    authorize(BILLING, RequestCode.BROKER_SEND, {"messages": [{"subject": "order.events#17"}]})
    with pytest.raises(ProtocolError) as refused:
        authorize(BILLING, RequestCode.BROKER_SEND, {"messages": [{"subject": "payment.events#3"}]})
    assert refused.value.code == ErrorCode.FORBIDDEN and "payment.events" in refused.value.message


@pytest.mark.parametrize(
    ("code", "body"),
    [
        (RequestCode.BROKER_PULL, {"subject": "order.events", "group": "ledger"}),
        (RequestCode.BROKER_QUEUE_LOCK, {"subject": "order.events", "group": "ledger", "queues": [1]}),
        (RequestCode.BROKER_ACK, {"acks": [["order.events#5", "ledger", "c", 3]]}),
        (RequestCode.BROKER_ACK, {"acks": [["%RETRY%order.events#5%ledger", "ledger", "c", 3]]}),
        (RequestCode.BROKER_NACK, {"nacks": [{"subject": "order.events#5", "group": "ledger"}]}),
        (RequestCode.BROKER_HEARTBEAT, {"consumers": [["order.events", "ledger", "c"]]}),
        (RequestCode.BROKER_LEAVE, {"leaves": [["%RETRY%order.events%ledger", "ledger", "c", 3]]}),
    ],
)
def test_consuming_requests_are_allowed_for_the_granted_pair(code, body):
    authorize(BILLING, code, body)
    other = {k: v for k, v in body.items()}
    if "group" in other:
        other["group"] = "audit"
    else:
        key = next(iter(other))
        item = other[key][0]
        other[key] = [[item[0], "audit", *item[2:]] if isinstance(item, list) else {**item, "group": "audit"}]
    with pytest.raises(ProtocolError) as refused:
        authorize(BILLING, code, other)
    assert refused.value.code == ErrorCode.FORBIDDEN and "audit" in refused.value.message


def test_administration_needs_an_admin_credential():
    with pytest.raises(ProtocolError) as refused:
        authorize(BILLING, RequestCode.BROKER_RESET, {"subject": "order.events", "group": "ledger"})
    assert refused.value.code == ErrorCode.FORBIDDEN
    authorize(Principal("c2", "ops", admin=True), RequestCode.BROKER_RESET, {})
