"""Actors: objects that own state and change it only inside their message handlers, one message at a time."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .loop import EventLoop

_HANDLES_ATTR = "__events_handles__"


def handles(*message_types: type) -> Callable[[Callable[..., Awaitable[Any]]], Callable[..., Awaitable[Any]]]:
    """Mark ``async def on_x(self, msg)`` as the handler of `message_types` (exact types, no subclasses).

    The handler's return value is the reply to `request()`; it is ignored for plain `send()`.
    """
    if not message_types:
        raise TypeError("@handles needs at least one message type")
    for t in message_types:
        if not isinstance(t, type):
            raise TypeError(f"@handles expects classes, got {t!r}")

    def mark(fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        if not inspect.iscoroutinefunction(fn):
            raise TypeError(f"handler {getattr(fn, '__qualname__', fn)!r} must be an async def")
        setattr(fn, _HANDLES_ATTR, getattr(fn, _HANDLES_ATTR, ()) + message_types)
        return fn

    return mark


def handler_methods(actor_cls: type) -> dict[str, tuple[type, ...]]:
    """Method name -> message types, over the MRO; an override without @handles keeps the base's types."""
    found: dict[str, tuple[type, ...]] = {}
    for klass in reversed(actor_cls.__mro__):
        for attr_name, value in vars(klass).items():
            types = getattr(value, _HANDLES_ATTR, None)
            if types is not None:
                found[attr_name] = types
    return found


class Actor:
    """Base class of every actor. Subclasses set `name` (class attribute or in ``__init__``; defaults to the
    class name) and declare handlers with `@handles`. An actor never holds another actor: it sends messages."""

    name: str
    loop: EventLoop

    async def send(self, msg: Any) -> None:
        await self.loop.send(msg, sender=self.name)

    def send_nowait(self, msg: Any) -> None:
        self.loop.send_nowait(msg, sender=self.name)

    async def request(self, msg: Any) -> Any:
        return await self.loop.request(msg, sender=self.name)

    def start_soon(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Run `fn(*args)` as a background task of the loop; a failure there stops the loop naming this actor."""
        self.loop.start_soon(fn, *args, owner=self.name)

    def now(self) -> float:
        return self.loop.clock.now()

    async def on_start(self) -> None:
        """Runs once in the actor's task before it handles any message."""

    async def on_stop(self) -> None:
        """Runs on clean shutdown, after every actor has stopped handling messages (other actors are gone)."""
