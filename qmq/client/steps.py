"""The steps of the client core's loops: what a loop asks its driver to do, as values (h11 style).

Every operation of the client (a route look-up, a send, a pull, a nack, an ack flush...) is a
generator, a `Steps[T]`: it yields one step, the driver does it and sends back the outcome, and the
generator's return value is the operation's result. A failed request comes back as a value too (the
exception it met, returned, not raised), so the loop, not the driver, decides what a failure means.

The blocking driver (`qmq.client.blocking`) does the steps with threads, the asyncio driver
(`qmq.client.aio`) with tasks; a test can do them by hand, without a socket.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from qmq.client.deliveries import SubscribeOptions

T = TypeVar("T")
C = TypeVar("C", bound=type)


@dataclass(frozen=True, slots=True)
class Call:
    """One request, waited for. Outcome: the reply's body, or the exception that stood in its way."""

    address: str
    code: int
    body: dict[str, Any] | None
    timeout_s: float


@dataclass(frozen=True, slots=True)
class Calls:
    """Requests that do not depend on each other, made at once where the driver can. Outcome: one
    outcome per call, as for `Call`, in order."""

    calls: list[Call]


@dataclass(frozen=True, slots=True)
class Sleep:
    """Wait `seconds` (a subscription's driver ends the wait early when the subscription closes).
    Outcome: None."""

    seconds: float


@dataclass(frozen=True, slots=True)
class Start:
    """Put a request in flight and go on. Outcome: its handle, a concurrent Future or an asyncio
    Task: the loop keeps it and reads it once done (`outcome`). A driver need not time it out: the
    loop gives up on a handle still not done after the request's `timeout_s`."""

    call: Call


@dataclass(frozen=True, slots=True)
class WaitAny:
    """Wait until one of `handles` (from `Start`) is done, at most `timeout_s`. Outcome: None."""

    handles: list[Any]
    timeout_s: float


@dataclass(frozen=True, slots=True)
class WaitAll:
    """Wait until all `handles` are done, at most `timeout_s`. Outcome: None."""

    handles: list[Any]
    timeout_s: float


@dataclass(frozen=True, slots=True)
class GetRoute:
    """A subscription asks its client for the subject's route. Outcome: the `Route`, or the
    `ClientError` that stood in its way."""

    subject: str


@dataclass(frozen=True, slots=True)
class Subscribe:
    """Open a subscription, with its own connections, and register it with every broker of its
    route. Outcome: the driver's subscription."""

    options: SubscribeOptions


Step = Call | Calls | Sleep | Start | WaitAny | WaitAll | GetRoute | Subscribe
Steps = Generator[Step, Any, T]


def outcome(handle: Any) -> Any:
    """The outcome of a finished, not cancelled request put in flight by `Start`, as for `Call` ({}
    for an empty reply)."""
    error = handle.exception()
    return error if error is not None else (handle.result() or {})


def bound(
    core: type, operations: Sequence[str], run: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> Callable[[C], C]:
    """A class decorator for a driver: each of `core`'s `operations` (loops of steps) becomes a
    method of the driver class that runs the loop with `run` (`blocking.blocking`, `aio.awaiting`)."""

    def decorate(cls: C) -> C:
        for name in operations:
            setattr(cls, name, run(getattr(core, name)))
        return cls

    return decorate
