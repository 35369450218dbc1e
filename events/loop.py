"""The event loop: routes each message by its exact type to the one actor that handles it, runs one task per
actor that drains its bounded mailbox in order, records the trace and owns the clock.

Failure model: any exception escaping a handler (or hook, or background task) stops the whole loop; `run()`
raises one `ActorError` (never an exception group) and every pending `request()` gets an error.
"""

from __future__ import annotations

import contextvars
import enum
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from types import MappingProxyType
from typing import Any

import trio
import trio.testing

from .actor import Actor, handler_methods
from .clock import Clock, WallClock
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
from .trace import Trace, TraceRecord

logger = logging.getLogger(__name__)

# Name of the actor whose task is running (None in background tasks and outside the loop): a task that blocks
# in a request or a full mailbox while this is set blocks that actor's mailbox, which is what deadlocks.
_current_actor: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "events_current_actor", default=None
)


class _State(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    CLOSED = "closed"


class _Route:
    __slots__ = ("actor", "tx", "handler", "type_name")

    def __init__(self, actor: str, tx: trio.MemorySendChannel, handler: Callable, type_name: str) -> None:
        self.actor = actor
        self.tx = tx
        self.handler = handler
        self.type_name = type_name


class _Reply:
    """Where a handler's return value (or the loop's error) meets the waiting requester."""

    __slots__ = ("event", "value", "error")

    def __init__(self) -> None:
        self.event = trio.Event()
        self.value: Any = None
        self.error: BaseException | None = None

    def resolve(self, value: Any) -> None:
        if not self.event.is_set():
            self.value = value
            self.event.set()

    def fail(self, error: BaseException) -> None:
        if not self.event.is_set():
            self.error = error
            self.event.set()


class _Envelope:
    __slots__ = ("msg", "sender", "sent", "reply", "route")

    def __init__(self, msg: Any, sender: str, sent: float, reply: _Reply | None, route: _Route) -> None:
        self.msg = msg
        self.sender = sender
        self.sent = sent
        self.reply = reply
        self.route = route


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            out.extend(_leaves(exc))
        elif not isinstance(exc, trio.Cancelled):
            out.append(exc)
    return out


def _collapse(group: BaseExceptionGroup, failure: ActorError | None) -> BaseException:
    """The one exception a user should see: the loop's failure if any, else a lone leaf, else the group."""
    leaves = _leaves(group)
    if failure is not None and leaves:
        return failure
    if len(leaves) == 1:
        return leaves[0]
    return group


class EventLoop:
    """Actor runtime on trio. Register actors, then ``await loop.run()`` (or ``async with loop.running()``)."""

    def __init__(
        self, clock: Clock | None = None, mailbox_size: int = 1024, trace_capacity: int = 100_000
    ) -> None:
        if mailbox_size < 0:
            raise ValueError(f"mailbox_size must be >= 0, got {mailbox_size}")
        self.clock: Clock = clock if clock is not None else WallClock()
        self.trace = Trace(trace_capacity)
        self.mailbox_size = mailbox_size
        self.num_dropped = 0  # plain messages discarded because the loop was stopping
        self._actors: dict[str, Actor] = {}
        self._receivers: dict[str, trio.MemoryReceiveChannel] = {}
        self._routes: dict[type, _Route] = {}
        self._state = _State.NEW
        self._stopping = False
        self._quiescent = False
        self._num_busy = 0  # actors inside on_start or a handler
        self._num_ready = 0
        self._failure: ActorError | None = None
        self._pending: set[_Reply] = set()
        self._waits_on: dict[str, str] = {}
        self._receive_scopes: dict[str, trio.CancelScope | None] = {}
        self._root_scope = trio.CancelScope()
        self._background: trio.Nursery | None = None
        self._all_ready = trio.Event()
        self._quiesced = trio.Event()
        self._started_or_closed = trio.Event()

    # ---- registration -------------------------------------------------------------------------------------

    def register(self, actor: Actor) -> None:
        """Add an actor and its handlers before `run()`; all-or-nothing on error."""
        if self._state is not _State.NEW:
            raise EventsError("actors must be registered before the loop runs")
        name = getattr(actor, "name", None) or type(actor).__name__
        if name in self._actors:
            raise DuplicateActorError(name)
        if getattr(actor, "loop", None) not in (None, self):
            raise EventsError(f"actor {name!r} is already registered with another loop")
        claimed: dict[type, tuple[str, Callable]] = {}
        for method_name, types in handler_methods(type(actor)).items():
            for t in types:
                if t in self._routes:
                    raise DuplicateHandlerError(t, self._routes[t].actor, name)
                if t in claimed:
                    raise DuplicateHandlerError(t, f"{name}.{claimed[t][0]}", f"{name}.{method_name}")
                claimed[t] = (method_name, getattr(actor, method_name))
        tx, rx = trio.open_memory_channel(self.mailbox_size)
        actor.name = name
        actor.loop = self
        self._actors[name] = actor
        self._receivers[name] = rx
        for t, (_, handler) in claimed.items():
            self._routes[t] = _Route(name, tx, handler, t.__name__)

    @property
    def actors(self) -> Mapping[str, Actor]:
        return MappingProxyType(self._actors)

    def handler_of(self, message_type: type) -> str | None:
        """Name of the actor handling `message_type`, or None."""
        route = self._routes.get(message_type)
        return route.actor if route is not None else None

    def mailbox_depths(self) -> dict[str, int]:
        return {name: rx.statistics().current_buffer_used for name, rx in self._receivers.items()}

    @property
    def is_running(self) -> bool:
        return self._state is _State.RUNNING

    # ---- sending ------------------------------------------------------------------------------------------

    def _route(self, msg: Any) -> _Route:
        route = self._routes.get(type(msg))
        if route is None:
            raise UnroutableMessageError(type(msg))
        return route

    async def send(self, msg: Any, *, sender: str) -> None:
        """Deliver `msg` to its handler's mailbox; waits while that mailbox is full (backpressure).

        Dropped silently once the loop has stopped (a plain message has no one to report to)."""
        route = self._route(msg)
        await self._deliver(_Envelope(msg, sender, self.clock.now(), None, route))

    def send_nowait(self, msg: Any, *, sender: str) -> None:
        """`send` for synchronous code in the trio thread; raises `MailboxFullError` instead of waiting."""
        route = self._route(msg)
        if self._quiescent:
            self.num_dropped += 1
            return
        try:
            route.tx.send_nowait(_Envelope(msg, sender, self.clock.now(), None, route))
        except trio.WouldBlock:
            raise MailboxFullError(route.actor, self.mailbox_size) from None
        except trio.BrokenResourceError:
            self.num_dropped += 1

    async def request(self, msg: Any, *, sender: str) -> Any:
        """Deliver `msg` and wait for its handler's return value.

        Raises the loop's `ActorError` if the handler fails, `LoopStoppedError` if the loop stops first, and
        `DeadlockError` if the calling actor would end up waiting on itself."""
        route = self._route(msg)
        if self._quiescent or self._state is _State.CLOSED:
            raise LoopStoppedError(f"event loop stopped; {route.type_name} to {route.actor!r} not delivered")
        waiter = _current_actor.get()
        if waiter is not None:
            self._check_deadlock(waiter, route.actor)  # early, so a doomed request is never enqueued
        reply = _Reply()
        self._pending.add(reply)
        try:
            delivered = await self._deliver(_Envelope(msg, sender, self.clock.now(), reply, route))
            if not delivered:
                raise LoopStoppedError(
                    f"event loop stopped; {route.type_name} to {route.actor!r} not delivered"
                )
            if waiter is None:
                await reply.event.wait()
            else:
                self._check_deadlock(waiter, route.actor)
                self._waits_on[waiter] = route.actor
                try:
                    await reply.event.wait()
                finally:
                    del self._waits_on[waiter]
        finally:
            self._pending.discard(reply)
        if reply.error is not None:
            raise reply.error
        return reply.value

    async def _deliver(self, env: _Envelope) -> bool:
        await trio.lowlevel.checkpoint_if_cancelled()
        if self._quiescent:
            self.num_dropped += 1
            await trio.lowlevel.cancel_shielded_checkpoint()
            return False
        tx = env.route.tx
        try:
            tx.send_nowait(env)
        except trio.WouldBlock:
            return await self._deliver_blocking(env)
        except trio.BrokenResourceError:
            self.num_dropped += 1
            await trio.lowlevel.cancel_shielded_checkpoint()
            return False
        await trio.lowlevel.cancel_shielded_checkpoint()
        return True

    async def _deliver_blocking(self, env: _Envelope) -> bool:
        waiter = _current_actor.get()
        if waiter is not None:
            self._check_deadlock(waiter, env.route.actor)
            self._waits_on[waiter] = env.route.actor
        try:
            await env.route.tx.send(env)
            return True
        except trio.BrokenResourceError:
            self.num_dropped += 1
            return False
        finally:
            if waiter is not None:
                del self._waits_on[waiter]

    def _check_deadlock(self, waiter: str, target: str) -> None:
        """Raise if `target` is (transitively) waiting on `waiter`: the wait we are about to add closes a cycle."""
        path = [waiter, target]
        node: str | None = target
        for _ in range(len(self._actors) + 1):
            if node == waiter:
                raise DeadlockError(path)
            node = self._waits_on.get(node)  # type: ignore[arg-type]
            if node is None:
                return
            path.append(node)

    # ---- background tasks ---------------------------------------------------------------------------------

    def start_soon(self, fn: Callable[..., Awaitable[Any]], *args: Any, owner: str = "external") -> None:
        """Run `fn(*args)` in the loop's background nursery (cancelled at shutdown, before `on_stop`).

        An exception there stops the loop with an `ActorError` naming `owner`."""
        if self._background is None or self._quiescent:
            raise EventsError("start_soon needs a running event loop")
        self._background.start_soon(self._run_background, owner, fn, args, name=getattr(fn, "__name__", None))

    async def _run_background(self, owner: str, fn: Callable[..., Awaitable[Any]], args: tuple) -> None:
        _current_actor.set(None)  # a background task blocks no mailbox
        try:
            await fn(*args)
        except Exception as exc:
            stage = f"background task {getattr(fn, '__qualname__', fn)!s}"
            self._fail(ActorError(owner, None, None, exc, stage=stage))

    # ---- running ------------------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start every actor (its `on_start`, then its mailbox loop); report started once all are ready;
        return after `shutdown()` once `on_stop` hooks ran. Raises a single `ActorError` if an actor fails."""
        if self._state is not _State.NEW:
            raise EventsError("an EventLoop runs only once")
        self._state = _State.RUNNING
        if isinstance(self.clock, WallClock) and isinstance(
            trio.lowlevel.current_clock(), trio.testing.MockClock
        ):
            logger.warning("event loop: WallClock under trio MockClock; trace times will not match sleeps")
        self._num_busy = len(self._actors)
        if not self._actors:
            self._all_ready.set()
            if self._stopping:
                self._quiesce()
        error: BaseException | None = None
        try:
            with self._root_scope:
                async with trio.open_nursery() as background:
                    self._background = background
                    async with trio.open_nursery() as actor_tasks:
                        for name, actor in self._actors.items():
                            actor_tasks.start_soon(self._actor_main, actor, self._receivers[name], name=name)
                        await self._all_ready.wait()
                        logger.debug("event loop: started %d actors", len(self._actors))
                        task_status.started()
                        self._started_or_closed.set()
                        await self._quiesced.wait()
                    background.cancel_scope.cancel()
                if self._failure is None:
                    await self._stop_actors()
        except BaseExceptionGroup as group:
            error = _collapse(group, self._failure)
        finally:
            self._close()
        error = error or self._failure
        if error is not None:
            raise error
        logger.debug("event loop: stopped cleanly (%d messages dropped at shutdown)", self.num_dropped)

    @asynccontextmanager
    async def running(self) -> AsyncIterator[EventLoop]:
        """Run the loop in the background for the body; shut it down cleanly on exit.

        Raises the loop's `ActorError` itself (not inside an exception group) if an actor fails."""
        error: BaseException | None = None
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(self.run)
                try:
                    yield self
                finally:
                    self.shutdown()
        except BaseExceptionGroup as group:
            error = _collapse(group, self._failure)
        if error is not None:
            raise error

    async def wait_started(self) -> None:
        """Wait until every actor ran `on_start`; raises `LoopStoppedError` if the loop stopped before that."""
        await self._started_or_closed.wait()
        if self._state is _State.CLOSED and not self._all_ready.is_set():
            raise LoopStoppedError("event loop stopped before it started") from self._failure

    def shutdown(self) -> None:
        """Stop cleanly: each actor finishes the message in hand (requests made by handlers still in progress
        are served; other queued messages are dropped), then `on_stop` hooks run and `run()` returns."""
        if self._stopping:
            return
        self._stopping = True
        logger.debug("event loop: shutdown requested")
        if self._state is _State.RUNNING and self._num_busy == 0:
            self._quiesce()

    def _quiesce(self) -> None:
        if self._quiescent:
            return
        self._quiescent = True
        self._quiesced.set()
        for scope in self._receive_scopes.values():
            if scope is not None:
                scope.cancel()

    def _fail(self, error: ActorError) -> None:
        if self._failure is None:
            self._failure = error
            logger.debug("event loop: failing: %s", error)
        self._stopping = True
        self._root_scope.cancel()
        self._fail_pending()

    def _fail_pending(self) -> None:
        for reply in list(self._pending):
            stopped = LoopStoppedError("event loop stopped before replying")
            stopped.__cause__ = self._failure
            reply.fail(stopped)

    def _close(self) -> None:
        self._state = _State.CLOSED
        self._quiescent = True
        self._background = None
        for rx in self._receivers.values():
            while True:
                try:
                    env = rx.receive_nowait()
                except (trio.WouldBlock, trio.ClosedResourceError, trio.EndOfChannel):
                    break
                if env.reply is None:
                    self.num_dropped += 1
            rx.close()  # senders blocked on a full mailbox wake with BrokenResourceError
        self._fail_pending()
        self._started_or_closed.set()

    async def _stop_actors(self) -> None:
        for name, actor in reversed(self._actors.items()):
            try:
                await actor.on_stop()
            except Exception as exc:
                if self._failure is None:
                    self._failure = ActorError(name, None, None, exc, stage="on_stop")

    async def _actor_main(self, actor: Actor, rx: trio.MemoryReceiveChannel) -> None:
        name = actor.name
        _current_actor.set(name)
        try:
            await actor.on_start()
        except Exception as exc:
            self._fail(ActorError(name, None, None, exc, stage="on_start"))
            return
        self._num_ready += 1
        if self._num_ready == len(self._actors):
            self._all_ready.set()
        self._num_busy -= 1
        if self._stopping and self._num_busy == 0:
            self._quiesce()
        clock = self.clock
        trace = self.trace
        scopes = self._receive_scopes
        while not self._quiescent:
            with trio.CancelScope() as scope:
                scopes[name] = scope
                env = await rx.receive()
            scopes[name] = None
            if scope.cancelled_caught:
                break
            reply = env.reply
            if self._stopping and (reply is None or self._quiescent):
                if reply is None:
                    self.num_dropped += 1
                else:
                    reply.fail(LoopStoppedError("event loop stopped before handling the request"))
                continue
            self._num_busy += 1
            started = clock.now()
            try:
                result = await env.route.handler(env.msg)
            except Exception as exc:
                self._num_busy -= 1
                if trace.capacity:
                    trace.add(_record(env, name, started, clock.now(), reply is not None,
                                      f"{type(exc).__name__}: {exc}"))
                failure = ActorError(name, env.route.type_name, env.sender, exc)
                if reply is not None:
                    reply.fail(ActorError(name, env.route.type_name, env.sender, exc))
                self._fail(failure)
                return
            except BaseException:
                self._num_busy -= 1
                raise
            self._num_busy -= 1
            if trace.capacity:
                trace.add(_record(env, name, started, clock.now(), reply is not None))
            if reply is not None:
                reply.resolve(result)
            if self._stopping and self._num_busy == 0:
                self._quiesce()


def _record(env, receiver: str, started: float, finished: float, is_request: bool,
            error: str | None = None) -> TraceRecord:
    """The trace entry of one handled message."""
    return TraceRecord(env.route.type_name, env.sender, receiver, env.sent, started, finished, is_request, error)
