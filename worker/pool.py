"""Where handlers run (`-P`): a pool of threads, one thread in the foreground (solo), or a pool of
processes. Every pool takes jobs from one queue in the order they were pulled and runs each through
the worker's `handle`, giving it the inner chain of the job's consumer for that executor.

- `threads`: `concurrency` threads in this process share the app's engine and clients (both are
  thread-safe). The right choice for handlers that wait on I/O, which most do.
- `processes`: `concurrency` child processes, started fresh (spawn, not fork): each imports the
  app itself and makes its own database connections, so none is ever shared across a fork. One
  thread here feeds each child; a child that dies mid-message (killed, out of memory) fails that
  message (`WorkerLost`, retried like any failure) and is replaced.
- `solo`: one message at a time in the main thread, for debuggers and the simplest deployments.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from qmq.client import Delivery
from worker.consumer import Consumer
from worker.errors import WorkerLost
from worker.outcome import Outcome
from worker.pipeline import inner_chain
from worker.steps.step import Call, Next

log = logging.getLogger("qmq.worker")

CHILD_STOP_TIMEOUT_S = 10.0
POOLS = ("threads", "processes", "solo")


@dataclass(slots=True)
class Job:
    feeder: Any  # worker.feeder.Feeder
    delivery: Delivery


Handle = Callable[[Job, Next], None]  # runs a job through its consumer's whole chain
Wrap = Callable[[Consumer, Next], Next]  # the outer steps around an inner chain


class Pool:
    """Threads taking jobs off one queue; a subclass says what the inner chain is for each."""

    def __init__(self, concurrency: int, handle: Handle, wrap: Wrap) -> None:
        self.concurrency = concurrency
        self.handle = handle
        self.wrap = wrap
        self.jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        for i in range(self.concurrency):
            thread = threading.Thread(target=self._loop, args=(i,), name=f"qmq-pool-{i}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def submit(self, feeder: Any, deliveries: list[Delivery]) -> None:
        """One job per delivery: whichever thread is free takes the next, so one slow handler holds up
        no other message."""
        for delivery in deliveries:
            self.jobs.put(Job(feeder, delivery))

    def close(self) -> None:
        """Finish every job submitted so far, then stop (see `join`)."""
        for _ in range(max(1, self.concurrency)):
            self.jobs.put(None)

    def join(self, timeout_s: float | None) -> bool:
        for thread in self._threads:
            thread.join(timeout_s)
        return not any(t.is_alive() for t in self._threads)

    def kill(self) -> None:
        """Cold shutdown: nothing to do for threads (the process exits under them)."""

    def inner(self, index: int, consumer: Consumer) -> Next:
        raise NotImplementedError

    def _loop(self, index: int) -> None:
        chains: dict[int, Next] = {}
        while (job := self.jobs.get()) is not None:
            consumer = job.feeder.consumer
            whole = chains.get(id(consumer))
            if whole is None:
                whole = chains[id(consumer)] = self.wrap(consumer, self.inner(index, consumer))
            self.handle(job, whole)
        self._stopped(index)

    def _stopped(self, index: int) -> None:
        pass


class ThreadPool(Pool):
    def inner(self, index: int, consumer: Consumer) -> Next:
        return inner_chain(consumer)


class SoloPool(ThreadPool):
    """Runs jobs in the thread that calls `run_here` (the main thread)."""

    def __init__(self, handle: Handle, wrap: Wrap) -> None:
        super().__init__(1, handle, wrap)
        self._finished = threading.Event()

    def start(self) -> None:
        pass

    def run_here(self) -> None:
        try:
            self._loop(0)
        finally:
            self._finished.set()

    def join(self, timeout_s: float | None) -> bool:
        return self._finished.wait(timeout_s)


class ProcessPool(Pool):
    def __init__(self, concurrency: int, handle: Handle, wrap: Wrap, app_spec: str, log_level: str) -> None:
        super().__init__(concurrency, handle, wrap)
        self.app_spec = app_spec
        self.log_level = log_level
        self._context = multiprocessing.get_context("spawn")
        self._children: list[Child | None] = [None] * concurrency
        self._lock = threading.Lock()

    def start(self) -> None:
        for i in range(self.concurrency):
            self._children[i] = self._spawn(i)
        super().start()

    def inner(self, index: int, consumer: Consumer) -> Next:
        def remote(call: Call) -> Outcome:
            child = self._children[index]
            if child is None or not child.alive:
                child = self._children[index] = self._spawn(index)
            try:
                return child.run(call)
            except WorkerLost as exc:
                self._children[index] = None
                return consumer.retry.decide(exc, call.message.attempts)

        return remote

    def _spawn(self, index: int) -> Child:
        from worker.child import child_main

        parent_end, child_end = self._context.Pipe()
        process = self._context.Process(
            target=child_main, args=(self.app_spec, child_end, self.log_level), name=f"qmq-pool-{index}", daemon=True
        )
        with self._lock:
            process.start()
        child_end.close()
        return Child(process, parent_end)

    def _stopped(self, index: int) -> None:
        child = self._children[index]
        if child is not None:
            child.stop()

    def kill(self) -> None:
        for child in self._children:
            if child is not None:
                child.process.kill()


class Child:
    """One pool process and the pipe to it: a message in, its outcome back."""

    def __init__(self, process: Any, conn: Connection) -> None:
        self.process = process
        self.conn = conn

    @property
    def alive(self) -> bool:
        return self.process.is_alive()

    def run(self, call: Call) -> Outcome:
        try:
            self.conn.send((call.consumer.subject, call.consumer.group, call.message))
            return self.conn.recv()
        except (EOFError, OSError) as exc:
            self.process.join(1.0)
            raise WorkerLost(
                f"pool process {self.process.pid} died (exit code {self.process.exitcode}) while handling this message"
            ) from exc

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.send(None)
        self.process.join(CHILD_STOP_TIMEOUT_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(CHILD_STOP_TIMEOUT_S)
        self.conn.close()
