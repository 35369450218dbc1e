"""EventLoop behaviour under trio's MockClock (autojump): deterministic, no real sleeps."""

from __future__ import annotations

import attrs
import pytest
import trio
import trio.testing

from ksana.events import (
    Actor,
    ActorError,
    DeadlockError,
    DuplicateActorError,
    DuplicateHandlerError,
    EventLoop,
    EventsError,
    LoopStoppedError,
    MailboxFullError,
    UnroutableMessageError,
    VirtualClock,
    advance,
    handles,
    run_blocking,
)


def run_virtual(fn):
    """Run `fn()` on a virtual clock; a hang becomes TooSlowError after a (virtual) day instead of blocking."""

    async def main():
        with trio.fail_after(86_400):
            return await fn()

    return trio.run(main, clock=VirtualClock.trio_clock())


@attrs.frozen
class Ping:
    n: int


@attrs.frozen
class Pong:
    n: int


@attrs.frozen
class Add:
    a: int
    b: int


@attrs.frozen
class Explode:
    reason: str


@attrs.frozen
class Work:
    seconds: float


class SubPing(Ping):
    pass


class Recorder(Actor):
    def __init__(self, name: str = "recorder") -> None:
        self.name = name
        self.seen: list = []

    @handles(Ping)
    async def on_ping(self, msg: Ping) -> None:
        self.seen.append(msg)


class PongRecorder(Actor):
    name = "pong"

    def __init__(self) -> None:
        self.seen: list = []

    @handles(Pong)
    async def on_pong(self, msg: Pong) -> None:
        self.seen.append(msg)


class Adder(Actor):
    name = "adder"

    @handles(Add)
    async def on_add(self, msg: Add) -> int:
        return msg.a + msg.b


class Gate(Actor):
    """Handles Ping only when its gate is open: lets a test hold a message in hand."""

    name = "gate"

    def __init__(self) -> None:
        self.open = trio.Event()
        self.in_hand = trio.Event()
        self.seen: list[int] = []

    @handles(Ping)
    async def on_ping(self, msg: Ping) -> None:
        self.in_hand.set()
        await self.open.wait()
        self.seen.append(msg.n)


class Bomb(Actor):
    name = "bomb"

    @handles(Explode)
    async def on_explode(self, msg: Explode) -> None:
        raise ValueError(msg.reason)


class Worker(Actor):
    name = "worker"

    def __init__(self) -> None:
        self.finished_at: list[float] = []

    @handles(Work)
    async def on_work(self, msg: Work) -> float:
        await advance(msg.seconds)
        self.finished_at.append(self.now())
        return self.now()


def test_routes_by_exact_type():
    async def main():
        loop = EventLoop(clock=VirtualClock())
        pings, pongs = Recorder(), PongRecorder()
        loop.register(pings)
        loop.register(pongs)
        assert loop.handler_of(Ping) == "recorder" and loop.handler_of(Pong) == "pong"
        async with loop.running():
            await loop.send(Ping(1), sender="external")
            await loop.send(Pong(2), sender="external")
            loop.send_nowait(Ping(3), sender="external")
            with pytest.raises(UnroutableMessageError, match="SubPing"):
                await loop.send(SubPing(4), sender="external")
            await trio.testing.wait_all_tasks_blocked()
        assert pings.seen == [Ping(1), Ping(3)]
        assert pongs.seen == [Pong(2)]

    run_virtual(main)


def test_unroutable_message_names_type():
    loop = EventLoop()
    loop.register(Adder())
    with pytest.raises(UnroutableMessageError, match="Pong") as info:
        loop.send_nowait(Pong(1), sender="external")
    assert info.value.message_type is Pong

    async def main():
        with pytest.raises(UnroutableMessageError, match="Ping"):
            await loop.request(Ping(1), sender="external")

    run_virtual(main)


def test_request_reply_external_and_between_actors():
    class Summer(Actor):
        name = "summer"

        @handles(Ping)
        async def on_ping(self, msg: Ping) -> int:
            return await self.request(Add(msg.n, 100))

    async def main():
        loop = EventLoop(clock=VirtualClock())
        loop.register(Adder())
        loop.register(Summer())
        async with loop.running():
            assert await loop.request(Add(2, 3), sender="external") == 5
            assert await loop.request(Ping(7), sender="external") == 107
        kinds = [(r.message_type, r.sender, r.receiver, r.is_request) for r in loop.trace.records()]
        assert ("Add", "summer", "adder", True) in kinds
        assert ("Ping", "external", "summer", True) in kinds

    run_virtual(main)


def test_duplicate_handler_error_names_type_and_both_actors():
    class OtherAdder(Actor):
        name = "other"

        @handles(Add, Ping)
        async def on_any(self, msg) -> None:
            pass

    loop = EventLoop()
    loop.register(Adder())
    with pytest.raises(DuplicateHandlerError, match="Add") as info:
        loop.register(OtherAdder())
    assert "adder" in str(info.value) and "other" in str(info.value)
    # registration is all-or-nothing: Ping stayed unclaimed
    assert loop.handler_of(Ping) is None and "other" not in loop.actors

    class TwoMethods(Actor):
        name = "two"

        @handles(Pong)
        async def first(self, msg) -> None:
            pass

        @handles(Pong)
        async def second(self, msg) -> None:
            pass

    with pytest.raises(DuplicateHandlerError, match="Pong"):
        EventLoop().register(TwoMethods())


def test_duplicate_actor_name_and_bad_handler_rejected():
    loop = EventLoop()
    loop.register(Recorder("same"))
    with pytest.raises(DuplicateActorError, match="same"):
        loop.register(PongRecorder.__new__(type("Same", (PongRecorder,), {"name": "same"})))
    with pytest.raises(TypeError, match="async"):

        class Sync(Actor):
            @handles(Ping)
            def on_ping(self, msg):  # not async
                pass


def test_actor_name_defaults_to_class_name():
    class Nameless(Actor):
        @handles(Ping)
        async def on_ping(self, msg) -> None:
            pass

    loop = EventLoop()
    actor = Nameless()
    loop.register(actor)
    assert actor.name == "Nameless" and actor.loop is loop


def test_bounded_mailbox_backpressure():
    async def main():
        loop = EventLoop(clock=VirtualClock(), mailbox_size=2)
        gate = Gate()
        loop.register(gate)
        async with loop.running():
            await loop.send(Ping(0), sender="external")
            await gate.in_hand.wait()  # message 0 taken out of the mailbox
            await loop.send(Ping(1), sender="external")
            await loop.send(Ping(2), sender="external")  # mailbox now full (2)
            assert loop.mailbox_depths() == {"gate": 2}
            with pytest.raises(MailboxFullError, match="gate"):
                loop.send_nowait(Ping(99), sender="external")
            sent = trio.Event()

            async def fast_sender():
                await loop.send(Ping(3), sender="external")
                sent.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(fast_sender)
                await trio.testing.wait_all_tasks_blocked()
                assert not sent.is_set()  # blocked by the full mailbox
                gate.open.set()
                await sent.wait()
                await trio.testing.wait_all_tasks_blocked()
        assert gate.seen == [0, 1, 2, 3]  # the rejected message was never delivered

    run_virtual(main)


def test_per_actor_order_with_interleaved_senders():
    async def main():
        loop = EventLoop(clock=VirtualClock(), mailbox_size=4)
        rec = Recorder()
        loop.register(rec)
        async with loop.running():

            async def sender(base: int):
                for i in range(50):
                    await loop.send(Ping(base + i), sender=f"s{base}")

            async with trio.open_nursery() as nursery:
                for base in (0, 1000, 2000):
                    nursery.start_soon(sender, base)
            await trio.testing.wait_all_tasks_blocked()
        got = [m.n for m in rec.seen]
        assert len(got) == 150
        for base in (0, 1000, 2000):
            assert [n for n in got if base <= n < base + 1000] == list(range(base, base + 50))
        # the trace records deliveries in the order they were handled
        assert [r.sender for r in loop.trace.records()] == [f"s{(n // 1000) * 1000}" for n in got]

    run_virtual(main)


def test_handler_runs_to_completion_before_next_message():
    class Slow(Actor):
        name = "slow"

        def __init__(self) -> None:
            self.log: list[str] = []

        @handles(Work)
        async def on_work(self, msg: Work) -> None:
            self.log.append(f"start {msg.seconds}")
            await advance(msg.seconds)
            self.log.append(f"end {msg.seconds}")

    async def main():
        loop = EventLoop(clock=VirtualClock())
        slow = Slow()
        loop.register(slow)
        async with loop.running():
            await loop.send(Work(2.0), sender="external")
            await loop.request(Work(1.0), sender="external")
        assert slow.log == ["start 2.0", "end 2.0", "start 1.0", "end 1.0"]

    run_virtual(main)


def test_actor_exception_stops_loop_with_actor_error_and_pending_requests_fail():
    async def main():
        loop = EventLoop(clock=VirtualClock())
        loop.register(Bomb())
        gate = Gate()
        loop.register(gate)
        outcomes: dict[str, BaseException] = {}

        async def requester(key: str, msg) -> None:
            try:
                await loop.request(msg, sender=key)
            except Exception as exc:
                outcomes[key] = exc

        async def driver():
            await loop.wait_started()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(requester, "waiting", Ping(1))  # held forever by the closed gate
                await gate.in_hand.wait()
                nursery.start_soon(requester, "client", Explode("boom"))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(driver)
            with pytest.raises(ActorError) as info:
                await loop.run()  # a bare ActorError, not an ExceptionGroup
        err = info.value
        assert err.actor == "bomb" and err.message_type == "Explode" and err.sender == "client"
        assert "bomb" in str(err) and "Explode" in str(err) and "client" in str(err) and "boom" in str(err)
        assert isinstance(err.__cause__, ValueError)
        assert isinstance(outcomes["client"], ActorError) and isinstance(
            outcomes["client"].__cause__, ValueError
        )
        assert isinstance(outcomes["waiting"], LoopStoppedError)
        assert outcomes["waiting"].__cause__ is err
        with pytest.raises(LoopStoppedError):
            await loop.request(Ping(2), sender="late")
        failed = [r for r in loop.trace.records() if r.error is not None]
        assert [(r.message_type, r.error) for r in failed] == [("Explode", "ValueError: boom")]

    run_virtual(main)


def test_running_context_raises_bare_actor_error():
    async def main():
        loop = EventLoop(clock=VirtualClock())
        loop.register(Bomb())
        with pytest.raises(ActorError, match="bomb") as info:
            async with loop.running():
                await loop.send(Explode("bang"), sender="external")
                await trio.sleep_forever()
        assert isinstance(info.value.__cause__, ValueError)

    run_virtual(main)


def test_on_start_failure_is_reported_through_nursery_start():
    class BadStart(Actor):
        name = "badstart"

        async def on_start(self) -> None:
            raise RuntimeError("no config")

    async def main():
        loop = EventLoop(clock=VirtualClock())
        loop.register(BadStart())
        async with trio.open_nursery() as nursery:
            with pytest.raises(ActorError, match="badstart.*on_start.*no config"):
                await nursery.start(loop.run)
        with pytest.raises(LoopStoppedError):
            await loop.wait_started()

    run_virtual(main)


def test_clean_shutdown_finishes_message_in_hand_and_runs_hooks():
    events: list[str] = []

    class Hooked(Actor):
        name = "hooked"

        async def on_start(self) -> None:
            events.append(f"start@{self.now()}")

        async def on_stop(self) -> None:
            events.append(f"stop@{self.now()}")

        @handles(Work)
        async def on_work(self, msg: Work) -> None:
            await advance(msg.seconds)
            # shutdown was requested meanwhile: the message in hand may still ask another actor
            total = await self.request(Add(1, 2))
            events.append(f"work {total}@{self.now()}")

    async def main():
        loop = EventLoop(clock=VirtualClock())
        loop.register(Hooked())
        loop.register(Adder())
        loop.register(Recorder())
        async with trio.open_nursery() as nursery:
            await nursery.start(loop.run)
            assert events == ["start@0.0"]
            await loop.send(Work(5.0), sender="external")
            await loop.send(Work(5.0), sender="external")  # queued behind the first: dropped at shutdown
            await trio.testing.wait_all_tasks_blocked()
            loop.send_nowait(Ping(1), sender="external")  # reaches an idle actor only after shutdown: dropped
            loop.shutdown()
        # run() returned: the nursery exited
        assert events == ["start@0.0", "work 3@5.0", "stop@5.0"]
        assert loop.num_dropped == 2  # the second Work and the Ping
        assert not loop.is_running
        await loop.send(Ping(2), sender="external")  # after the loop: dropped, not an error
        with pytest.raises(LoopStoppedError):
            await loop.request(Add(1, 1), sender="external")
        with pytest.raises(EventsError, match="once"):
            await loop.run()

    run_virtual(main)


def test_shutdown_wakes_sender_blocked_on_full_mailbox():
    async def main():
        loop = EventLoop(clock=VirtualClock(), mailbox_size=1)
        gate = Gate()
        loop.register(gate)
        blocked_done = trio.Event()

        async def blocked_sender():
            await loop.send(Ping(2), sender="external")
            blocked_done.set()

        async with trio.open_nursery() as nursery:
            await nursery.start(loop.run)
            await loop.send(Ping(0), sender="external")
            await gate.in_hand.wait()
            await loop.send(Ping(1), sender="external")
            nursery.start_soon(blocked_sender)
            await trio.testing.wait_all_tasks_blocked()
            assert not blocked_done.is_set()
            loop.shutdown()
            gate.open.set()
        assert blocked_done.is_set()
        assert gate.seen == [0]

    run_virtual(main)


def test_virtual_clock_advances_through_sleep_without_real_time():
    async def main():
        loop = EventLoop(clock=VirtualClock())
        worker = Worker()
        loop.register(worker)
        async with loop.running():
            assert loop.clock.now() == 0.0
            assert await loop.request(Work(3600.0), sender="external") == 3600.0
            await loop.send(Work(1.5), sender="external")
            assert await loop.request(Work(0.5), sender="external") == 3602.0  # in order: after Work(1.5)
        assert worker.finished_at == [3600.0, 3601.5, 3602.0]
        first, second, third = loop.trace.records()
        assert (first.sent, first.started, first.finished) == (0.0, 0.0, 3600.0)
        assert (second.started, second.finished) == (3600.0, 3601.5)
        assert third.sent == 3600.0 and third.started == 3601.5 and third.queue_s == 1.5

    run_virtual(main)


def test_request_cycle_is_reported_not_hung():
    @attrs.frozen
    class AskB:
        pass

    @attrs.frozen
    class AskA:
        pass

    class A(Actor):
        name = "a"

        @handles(AskA)
        async def on_ask(self, msg) -> None:
            await self.request(AskB())

    class B(Actor):
        name = "b"

        @handles(AskB)
        async def on_ask(self, msg) -> None:
            await self.request(AskA())  # a is blocked waiting for us

    async def main():
        loop = EventLoop(clock=VirtualClock())
        loop.register(A())
        loop.register(B())
        with pytest.raises(ActorError) as info:
            async with loop.running():
                await loop.send(AskA(), sender="external")
                await trio.sleep_forever()
        assert info.value.actor == "b"
        assert isinstance(info.value.__cause__, DeadlockError)
        assert info.value.__cause__.cycle == ["b", "a", "b"]

    run_virtual(main)


def test_self_request_is_a_deadlock_error():
    class Selfish(Actor):
        name = "selfish"

        @handles(Ping)
        async def on_ping(self, msg: Ping) -> None:
            await self.request(Add(1, 1))

        @handles(Add)
        async def on_add(self, msg: Add) -> int:
            return 2

    async def main():
        loop = EventLoop(clock=VirtualClock())
        loop.register(Selfish())
        with pytest.raises(ActorError, match="selfish -> selfish"):
            async with loop.running():
                await loop.send(Ping(1), sender="external")
                await trio.sleep_forever()

    run_virtual(main)


def test_background_task_failure_names_owner_and_blocking_work_takes_no_virtual_time():
    class Streamer(Actor):
        name = "streamer"

        def __init__(self) -> None:
            self.ticks: list[float] = []

        @handles(Ping)
        async def on_ping(self, msg: Ping) -> None:
            self.start_soon(self.tick)

        async def tick(self) -> None:
            while True:
                await advance(1.0)
                self.ticks.append(self.now())
                if len(self.ticks) == 3:
                    raise KeyError("stream lost")

        @handles(Add)
        async def on_add(self, msg: Add) -> int:
            self.product_started_at = self.now()
            return await run_blocking(lambda: msg.a * msg.b)  # blocking work off the loop

    async def main():
        loop = EventLoop(clock=VirtualClock())
        streamer = Streamer()
        loop.register(streamer)
        with pytest.raises(ActorError, match="streamer.*background task.*stream lost"):
            async with loop.running():
                assert await loop.request(Add(6, 7), sender="external") == 42
                assert streamer.product_started_at == loop.clock.now() == 0.0
                await loop.send(Ping(0), sender="external")
                await trio.sleep_forever()
        assert streamer.ticks == [1.0, 2.0, 3.0]
        with pytest.raises(EventsError, match="running"):
            loop.start_soon(trio.sleep, 1)

    run_virtual(main)


def test_messages_sent_before_run_are_delivered_and_register_after_run_fails():
    async def main():
        loop = EventLoop(clock=VirtualClock())
        rec = Recorder()
        loop.register(rec)
        await loop.send(Ping(1), sender="external")
        async with loop.running():
            with pytest.raises(EventsError, match="before"):
                loop.register(PongRecorder())
            await trio.testing.wait_all_tasks_blocked()
        assert rec.seen == [Ping(1)]

    run_virtual(main)


def test_run_blocking_uses_a_thread_under_the_real_clock():
    import threading

    async def main():
        return await run_blocking(lambda: threading.current_thread() is threading.main_thread())

    assert trio.run(main) is False


def test_actor_can_shut_the_loop_down_from_its_handler():
    class Finisher(Actor):
        name = "finisher"

        def __init__(self) -> None:
            self.stopped_at: float | None = None

        async def on_start(self) -> None:
            await self.send(Work(2.0))  # a perf backend kicks itself off the same way

        @handles(Work)
        async def on_work(self, msg: Work) -> None:
            await advance(msg.seconds)
            self.loop.shutdown()

        async def on_stop(self) -> None:
            self.stopped_at = self.now()

    async def main():
        loop = EventLoop(clock=VirtualClock())
        finisher = Finisher()
        loop.register(finisher)
        await loop.run()  # returns by itself
        assert finisher.stopped_at == 2.0
        assert [(r.message_type, r.sender) for r in loop.trace.records()] == [("Work", "finisher")]

    run_virtual(main)


def test_running_context_passes_body_errors_and_outer_cancellation_through():
    async def main():
        loop = EventLoop(clock=VirtualClock())
        loop.register(Recorder())
        with pytest.raises(KeyError, match="body"):  # bare, not an ExceptionGroup
            async with loop.running():
                raise KeyError("body")
        assert not loop.is_running
        other = EventLoop(clock=VirtualClock())
        other.register(Recorder())
        with trio.move_on_after(5) as scope:
            async with other.running():
                await trio.sleep_forever()
        assert scope.cancelled_caught and trio.current_time() == 5.0

    run_virtual(main)
