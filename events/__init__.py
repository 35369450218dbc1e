"""Ksana's actor runtime on trio: typed message routing, bounded mailboxes, a trace, wall or virtual clocks."""

from events.actor import Actor, handles
from events.clock import Clock, VirtualClock, WallClock, advance, run_blocking
from events.errors import (
    ActorError,
    DeadlockError,
    DuplicateActorError,
    DuplicateHandlerError,
    EventsError,
    LoopStoppedError,
    MailboxFullError,
    UnroutableMessageError,
)
from events.lane import BlockingLane
from events.loop import EventLoop
from events.trace import Trace, TraceRecord

__all__ = [
    "Actor",
    "ActorError",
    "BlockingLane",
    "Clock",
    "DeadlockError",
    "DuplicateActorError",
    "DuplicateHandlerError",
    "EventLoop",
    "EventsError",
    "LoopStoppedError",
    "MailboxFullError",
    "Trace",
    "TraceRecord",
    "UnroutableMessageError",
    "VirtualClock",
    "WallClock",
    "advance",
    "handles",
    "run_blocking",
]
