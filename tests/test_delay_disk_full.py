"""The delay server on a full disk: sends are refused while it is full (nothing accepted is lost),
and once space is freed it takes sends again without a restart, and every accepted message fires."""

from __future__ import annotations

import time

from qmq.client import Client, OutgoingMessage
from tests.support.broker import start_broker
from tests.support.delay import Arrivals, start_delay_server
from tests.test_disk_full import DEADLINE_S, LEFT_FREE_BYTES, free_bytes, small_file_system, wait_until

BODY = "p" * 32 * 1024
DUE_IN_MS = 4000


def test_a_full_disk_refuses_delayed_sends_and_freed_space_brings_the_delay_server_back(processes, tmp_path) -> None:
    broker = start_broker(processes, tmp_path / "broker")
    with small_file_system(tmp_path / "fs") as fs:
        delay = start_delay_server(processes, fs / "delay", "--broker", broker.address)
        # delivery_timeout_s=0: a refused send is reported at once, not offered again until space is freed
        with Client(brokers=[broker.address], delay_servers=[delay.address], delivery_timeout_s=0) as client:
            arrivals = Arrivals(client, "later")
            try:
                due = int(time.time() * 1000) + DUE_IN_MS
                accepted = [client.send([OutgoingMessage("later", BODY, deliver_at=due)])[0]]
                assert accepted[0].ok, accepted[0]
                ballast = fs / "ballast"
                with ballast.open("wb") as f:
                    f.write(bytes(max(0, free_bytes(fs) - LEFT_FREE_BYTES)))
                refused = None
                for _ in range(2000):
                    [result] = client.send([OutgoingMessage("later", BODY, deliver_at=due)])
                    if not result.ok:
                        refused = result
                        break
                    accepted.append(result)
                assert refused is not None, "the disk never filled"
                assert "No space left" in (refused.error or ""), refused
                stats = delay.stats()
                assert stats["read_only"] is True and "No space left" in stats["read_only_reason"], stats
                ballast.unlink()
                wait_until(lambda: not delay.stats()["read_only"], "the delay server to take sends again")
                [after] = client.send([OutgoingMessage("later", BODY, deliver_at=int(time.time() * 1000) + 500)])
                assert after.ok, after
                accepted.append(after)
                ids = {r.message_id for r in accepted}
                assert not arrivals.wait_for(ids, DEADLINE_S), "accepted messages that never fired"
                assert all(len(arrivals.received[i]) == 1 for i in ids), "a message fired twice"
                assert delay.proc.poll() is None
            finally:
                arrivals.close()
