"""Errors raised by the actor runtime; each names what the user needs to find the fault."""

from __future__ import annotations


class EventsError(Exception):
    """Base class of every error the event loop raises itself."""


class DuplicateHandlerError(EventsError):
    """Two actors (or two methods of one actor) claim the same message type: routing must be unambiguous."""

    def __init__(self, message_type: type, existing: str, new: str) -> None:
        self.message_type = message_type
        self.existing = existing
        self.new = new
        super().__init__(
            f"message type {message_type.__qualname__} is already handled by {existing!r}; "
            f"{new!r} also declares a handler for it"
        )


class DuplicateActorError(EventsError):
    """Actor names identify receivers in the trace and in errors, so they must be unique within a loop."""

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(f"an actor named {name!r} is already registered")


class UnroutableMessageError(EventsError):
    """No registered actor handles this exact message type (routing does not follow subclasses)."""

    def __init__(self, message_type: type) -> None:
        self.message_type = message_type
        super().__init__(f"no actor handles message type {message_type.__qualname__}")


class MailboxFullError(EventsError):
    """`send_nowait` found the receiver's bounded mailbox full."""

    def __init__(self, actor: str, mailbox_size: int) -> None:
        self.actor = actor
        self.mailbox_size = mailbox_size
        super().__init__(f"mailbox of actor {actor!r} is full ({mailbox_size} messages)")


class DeadlockError(EventsError):
    """An actor would wait on itself through a chain of requests or full mailboxes, which never resolves."""

    def __init__(self, cycle: list[str]) -> None:
        self.cycle = cycle
        super().__init__("actor wait cycle would deadlock: " + " -> ".join(cycle))


class LoopStoppedError(EventsError):
    """The loop stopped (shutdown or failure) before a request could be answered."""


class ActorError(EventsError):
    """An actor failed; the loop stopped. The original exception is ``__cause__``."""

    def __init__(
        self,
        actor: str,
        message_type: str | None,
        sender: str | None,
        cause: BaseException,
        *,
        stage: str = "handler",
    ) -> None:
        self.actor = actor
        self.message_type = message_type
        self.sender = sender
        self.stage = stage
        if message_type is not None:
            where = f"handling {message_type} from {sender!r}"
        else:
            where = f"in {stage}"
        super().__init__(f"actor {actor!r} failed {where}: {type(cause).__name__}: {cause}")
        self.__cause__ = cause
