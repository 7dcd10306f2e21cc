"""The pull loop of an ordered consumer (`@app.consumer(..., ordered=True)`, docs/ordering.md).

Two threads. The lease thread asks the brokers, every `LOCK_EVERY_S`, for the leases of this
worker's even share of the subject's queues (`qmq.client.ordering.share` over the members the
brokers report), renews them, and gives back a queue outside its share once nothing of it is
running or waiting here, so another worker takes it only after this one let go (or after its lease
expired, if this one died or stopped). The pull thread pulls the queues it holds and puts what comes
into the `KeyGate`, which lets one message of a key out at a time; the pool runs them.

A queue is run here only while its lease is good by this worker's clock (`admit`): a worker that
was stopped (SIGSTOP) and resumes after its lease ran out starts nothing of that queue until the
brokers confirm it again. A queue granted anew, or taken by another worker, drops what was waiting
here: the brokers hand it out again, from the oldest message not acknowledged, to whoever holds it.

Settling: a success is acknowledged and lets the key's next message out; a failure is retried in
place, after the consumer's backoff, with its key waiting and the other keys going on; a message
out of retries is dead-lettered and its key goes on (`on_poison="dead-letter"`) or stops, its later
messages parked as dead letters behind it, until an operator re-drives them (`on_poison="stop"`).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any

from qmq.client import ClientError, Delivery
from qmq.client.ordering import QueueLocks
from worker.feeder import PULL_WAIT_S, Feeder
from worker.key_gate import KeyGate, gate_key
from worker.outcome import Kind, Outcome

log = logging.getLogger("qmq.worker")

LOCK_EVERY_S = 1.0  # leases asked for and renewed this often (the broker's lease lasts 20 s)
LEASE_MARGIN_S = 2.0  # a lease is trusted here until this long before the broker's expiry
IDLE_WAIT_S = 0.2  # holding no queue, the pull thread looks again after this long


class OrderedFeeder(Feeder):
    ordered = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """As `Feeder`'s."""
        super().__init__(*args, **kwargs)
        self.gate = KeyGate()
        self.held: dict[int, float] = {}  # queue -> trusted until (monotonic)
        self.share: set[int] = set()
        self.members: list[str] = []
        self._gate_lock = threading.Lock()
        self._orphans: dict[int, list[Delivery]] = {}  # pulled for queues no longer held here (see _orphan)
        self._lease_thread = threading.Thread(
            target=self._lease_loop, name=f"qmq-lease-{self.consumer.name}", daemon=True
        )

    def start(self) -> None:
        super().start()
        self._lease_thread.start()

    # ---- leases ---------------------------------------------------------------------------------------

    def _lease_loop(self) -> None:
        self.subscribed.wait()
        while not self._stop.is_set():
            try:
                self.lease_tick()
            except ClientError as exc:
                self._trouble(f"cannot ask for the queues of {self.consumer.subject}: {exc}")
            except Exception as exc:  # a bug must not end the leases silently
                log.exception("ordered leases of %s failed", self.consumer.name)
                self._trouble(f"ordered leases failed: {exc!r}")
            self._stop.wait(LOCK_EVERY_S)

    def lease_tick(self) -> None:
        """Ask for this worker's share, renew what it holds, give back what it should not hold."""
        from qmq.client.ordering import share

        c = self.consumer
        with self._gate_lock:
            self.share = set(share(self.members, self.consumer_id))
            busy = self.gate.busy_queues()
            release = [q for q in self.held if q not in self.share and q not in busy]
            wanted = (self.share | set(self.held)) - set(release)
        asked_at = time.monotonic()
        locks = self.client.lock_queues(c.subject, c.group, self.consumer_id, wanted, release)
        dropped: list[Delivery] = []
        with self._gate_lock:
            self.members = locks.members
            trusted_until = asked_at + locks.lease_s - LEASE_MARGIN_S
            lost = set(self.held) - locks.held - set(release)
            for q in locks.granted | {q for q in lost if q in locks.others}:
                dropped += self.gate.drop_queue(q)  # handed out again by the broker: ours were released
            self.held = {q: trusted_until for q in locks.held}
            acked_elsewhere, back = self._settle_orphans(locks)
            orphaned = self._orphan(self.gate.busy_queues() - set(self.held))
            parked: list[Delivery] = []
            for q, order_keys in locks.stopped.items():  # stopped before, by this worker or another
                for order_key in order_keys:
                    if (q, order_key) not in self.gate.stopped:
                        parked += self.gate.stop_key((q, order_key), "a poison message")
            pulled = sorted(q for q in self.held if q in self.share)
            ready = self.gate.take(self._may_run)
        assert self.subscription is not None
        self.subscription.set_queues(pulled)
        self._forget(dropped)
        self._forget(acked_elsewhere, counted=False)
        if back:
            self.capacity.received(0, back)
        if orphaned:
            self.capacity.dropped(orphaned)
        self._park(parked)
        if locks.granted or lost or release:
            log.info(
                "%s: holding %d queues (granted %s, released %s, lost %s; %d members)",
                c.name,
                len(locks.held),
                sorted(locks.granted),
                sorted(release),
                sorted(lost),
                len(locks.members),
            )
        if ready:
            self.dispatch(self, ready)
        self._fine()

    def _may_run(self, queue: int) -> bool:
        return self.held.get(queue, 0.0) > time.monotonic()

    def _forget(self, deliveries: list[Delivery], counted: bool = True) -> None:
        """Deliveries of a queue handed out again by the broker: done here (their acks change nothing).
        `counted`: they still count in the worker's capacity."""
        if not deliveries:
            return
        assert self.subscription is not None
        for delivery in deliveries:
            self.subscription.ack(delivery)
        if counted:
            self.capacity.dropped(len(deliveries))

    def _orphan(self, queues: set[int]) -> int:
        """Set aside what waits here of `queues`, which this worker does not hold (it gave them back,
        or could not renew them): not run, not acknowledged (the broker hands them to the queue's next
        holder, from its own record), and not counted against the worker's capacity. How many."""
        count = 0
        for q in queues:
            waiting = self.gate.drop_queue(q)
            if waiting:
                self._orphans.setdefault(q, []).extend(waiting)
                count += len(waiting)
        return count

    def _settle_orphans(self, locks: QueueLocks) -> tuple[list[Delivery], int]:
        """What was set aside, once the brokers said what became of its queue: handed out again
        (granted anew here, or held by another: the broker released them) -> done, to acknowledge;
        held again here without a new grant (a renewal after a missed one) -> back in line. Returns
        the deliveries to mark done and how many went back in line."""
        done: list[Delivery] = []
        back = 0
        for q in list(self._orphans):
            if q in locks.granted or q in locks.others:
                done += self._orphans.pop(q)
            elif q in locks.held:
                waiting = self._orphans.pop(q)
                self.gate.add(waiting)
                back += len(waiting)
        return done, back

    def leave(self) -> None:
        """Give back every lease (a warm shutdown, after the last acks went out)."""
        try:
            self.client.lock_queues(
                self.consumer.subject, self.consumer.group, self.consumer_id, (), self.held, leave=True
            )
        except Exception as exc:
            log.warning(
                "%s: could not give back the queue leases (%s); they expire by themselves", self.consumer.name, exc
            )
        self.held = {}

    # ---- pulling --------------------------------------------------------------------------------------

    def _subscription_options(self) -> dict[str, Any]:
        return {"ordered": True}

    def _may_pull(self) -> bool:
        if self.held:
            return True
        self._stop.wait(IDLE_WAIT_S)
        return False

    def _deliver(self, deliveries: list[Delivery]) -> None:
        self._arrived(deliveries)

    def _pull(self, take: int) -> list[Delivery]:
        assert self.subscription is not None
        try:
            deliveries = self.subscription.pull(max=take, wait_s=PULL_WAIT_S)
        except ClientError as exc:
            self._trouble(str(exc))
            self._stop.wait(1.0)
            return []
        except Exception as exc:
            log.exception("pulling %s failed", self.consumer.name)
            self._trouble(f"pulling failed: {exc!r}")
            self._stop.wait(0.5)
            return []
        self._fine()
        return deliveries

    def _arrived(self, deliveries: list[Delivery]) -> None:
        with self._gate_lock:
            parked = self.gate.add(deliveries)
            # Pulled for a queue given back (or not renewed) meanwhile: set aside, see _orphan.
            orphaned = self._orphan({gate_key(d)[0] for d in deliveries} - set(self.held))
            ready = self.gate.take(self._may_run)
        if orphaned:
            self.capacity.dropped(orphaned)
        self._park(parked)
        if ready:
            self.dispatch(self, ready)

    # ---- running and settling (pool threads) ------------------------------------------------------------

    def admit(self, delivery: Delivery) -> bool:
        """Whether the delivery may start now (its queue's lease is good); if not it waits in line."""
        with self._gate_lock:
            if self._may_run(gate_key(delivery)[0]):
                return True
            self.gate.put_back(delivery)
        return False

    def settle(self, delivery: Delivery, outcome: Outcome) -> None:
        assert self.subscription is not None
        if outcome.kind is Kind.RETRY:
            timer = threading.Timer(outcome.delay_s, self._retry, (delivery,))
            timer.daemon = True
            timer.start()
            return
        parked: list[Delivery] = []
        stops = outcome.kind is Kind.DEAD and self.consumer.on_poison == "stop"
        if outcome.kind in (Kind.ACK, Kind.DUPLICATE):
            self.subscription.ack(delivery)
        else:  # the brokers remember a stopped key, for whoever holds the queue next
            stop_key = gate_key(delivery)[1] if stops else None
            self.subscription.nack(delivery, 0.0, dead=True, reason=outcome.reason, stop_key=stop_key)
        with self._gate_lock:
            if stops:
                parked = self.gate.stop(delivery)
                log.error(
                    "%s: key %s stopped at its poison message %s; its next messages are parked as dead letters "
                    "until an operator re-drives them",
                    self.consumer.name,
                    gate_key(delivery)[1],
                    delivery.id,
                )
            else:
                self.gate.done(delivery)
            ready = self.gate.take(self._may_run)
        self._park(parked)
        if ready:
            self.dispatch(self, ready)

    def _retry(self, delivery: Delivery) -> None:
        """Run a failed delivery again, in place, its key still waiting for it."""
        again = dataclasses.replace(delivery, attempt=delivery.attempt + 1)
        self.capacity.received(0, 1)
        self.dispatch(self, [again])

    def _park(self, deliveries: list[Delivery]) -> None:
        """Dead-letter the deliveries of a stopped key, behind its poison message, in order."""
        if not deliveries:
            return
        assert self.subscription is not None
        for delivery in deliveries:
            poison = self.gate.stopped.get(gate_key(delivery), "?")
            self.subscription.nack(
                delivery, 0.0, dead=True, reason=f"parked behind {poison}: its key stopped (on_poison='stop')"
            )
        self.capacity.dropped(len(deliveries))
