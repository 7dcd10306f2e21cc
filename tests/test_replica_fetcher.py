"""The replica fetcher against a master that misbehaves (qmq/replication/fetcher.py): a reply it
cannot read must not end replication until a restart. The master here is a small asyncio server
speaking the real protocol (qmq.protocol) over a real socket, so the test chooses each reply."""

from __future__ import annotations

import asyncio
import errno
from typing import Any

from qmq.protocol import Connection, HandshakeAccepted, Request, RequestCode, Role
from qmq.replication.fetcher import Fetcher
from qmq.store.store import LogStore

REPLY_WAIT_S = 30.0  # generous: a loaded CI machine; the event ends the wait as soon as it happens


class ScriptedMaster:
    """Answers each REPL_FETCH with the next of `replies`, then with empty, well-formed ones."""

    def __init__(self, replies: list[dict[str, Any]]) -> None:
        self.replies = replies
        self.fetches: list[dict[str, Any]] = []
        self.connections = 0
        self.fetched = asyncio.Event()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        conn = Connection(Role.SERVER)
        try:
            while data := await reader.read(65536):
                conn.receive_data(data)
                while isinstance(event := conn.next_event(), HandshakeAccepted | Request):
                    if isinstance(event, HandshakeAccepted):
                        writer.write(event.reply)
                    elif event.code == RequestCode.REPL_FETCH and not event.oneway:
                        self.fetches.append(event.body)
                        self.fetched.set()
                        reply = self.replies.pop(0) if self.replies else {"epoch": 1, "data": b"", "end": 0}
                        writer.write(conn.send_response(event.request_id, event.code, reply))
                await writer.drain()
        finally:
            writer.close()

    async def wait_fetches(self, count: int) -> None:
        async with asyncio.timeout(REPLY_WAIT_S):
            while len(self.fetches) < count:
                self.fetched.clear()
                await self.fetched.wait()


def run_fetcher(tmp_path, master: ScriptedMaster, fetches: int, **options: Any) -> Fetcher:
    async def main() -> Fetcher:
        server = await asyncio.start_server(master.serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        store = LogStore(tmp_path / "replica")
        fetcher = Fetcher(
            store,
            group="g1",
            address="127.0.0.1:1",
            master=f"127.0.0.1:{port}",
            epoch=1,
            epochs=[(1, 0)],
            wait_ms=10,
            **{"save_epochs": lambda epochs: None, **options},
        )
        fetcher.start()
        try:
            await master.wait_fetches(fetches)
        finally:
            await fetcher.stop()
            store.close()
            server.close()
            await server.wait_closed()
        return fetcher

    return asyncio.run(main())


def test_a_reply_the_replica_cannot_read_is_fetched_again_on_a_new_connection(tmp_path) -> None:
    malformed = {"epoch": 1, "data": b"", "end": "not an offset"}  # int() of it raises ValueError
    master = ScriptedMaster([malformed])
    fetcher = run_fetcher(tmp_path, master, fetches=3)
    assert master.connections >= 2  # the connection that carried the bad reply was dropped
    assert fetcher.fetches >= 2  # and fetching went on: replies after the bad one were read
    assert [f["offset"] for f in master.fetches[:3]] == [0, 0, 0]


def test_an_epochs_file_that_cannot_be_saved_is_the_stores_trouble_not_an_unreachable_master(tmp_path) -> None:
    """A full disk while saving the epochs file must not tell the meta server the master is lost (a
    replica saying so hastens a failover); the fetcher keeps its old epochs and tries again."""

    def full_disk(epochs) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    unreachable: list[bool] = []
    newer_epochs = {"epoch": 2, "data": b"", "end": 0, "epochs": [[1, 0], [2, 0]]}
    master = ScriptedMaster([newer_epochs, newer_epochs])
    fetcher = run_fetcher(
        tmp_path, master, fetches=3, save_epochs=full_disk, on_unreachable=lambda: unreachable.append(True)
    )
    assert unreachable == [] and not fetcher.unreachable
    assert fetcher.epochs == [(1, 0)]  # what it could not save, it does not hold either
