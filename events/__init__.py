"""Ksana's actor runtime on trio: typed message routing, bounded mailboxes, a trace, wall or virtual clocks."""

from .actor import Actor, handles
from .clock import Clock, VirtualClock, WallClock, advance, run_blocking
from .errors import (
    ActorError,
    DeadlockError,
    DuplicateActorError,
    DuplicateHandlerError,
    EventsError,
    LoopStoppedError,
    MailboxFullError,
    UnroutableMessageError,
)
from .lane import BlockingLane
from .loop import EventLoop
from .trace import Trace, TraceRecord

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
