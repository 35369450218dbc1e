"""Which pair serves a request: ``random`` (KsanaLLM's only policy) or ``least_in_flight``.

Both choose among the routable pairs only: active, with both rank-0 nodes online now. ``least_in_flight`` counts
the requests this router has open on each node (a prefill node's count drops when its response ends, a decode
node's when the client's does) and takes the pair whose two nodes hold the fewest together, at random among ties:
a node shared by several pairs counts once for all of them.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import attrs

if TYPE_CHECKING:  # the CLI reads the policy names without loading the registry's database layer
    from ksana.router.registry import Route


@attrs.define
class InFlight:
    """Open upstream requests per node address."""

    counts: Counter[str] = attrs.field(factory=Counter)

    def begin(self, addr: str) -> None:
        self.counts[addr] += 1

    def end(self, addr: str) -> None:
        self.counts[addr] -= 1
        if self.counts[addr] <= 0:
            del self.counts[addr]

    def __getitem__(self, addr: str) -> int:
        return self.counts[addr]


class Policy(Protocol):
    name: str

    def choose(self, routes: Sequence[Route], in_flight: InFlight) -> Route: ...


@attrs.define
class RandomPolicy:
    """KsanaLLM's: shuffle the pairs and take the first usable one, i.e. a uniform pick among usable pairs."""

    rng: random.Random = attrs.field(factory=random.Random)
    name: str = "random"

    def choose(self, routes: Sequence[Route], in_flight: InFlight) -> Route:
        return self.rng.choice(routes)


@attrs.define
class LeastInFlightPolicy:
    rng: random.Random = attrs.field(factory=random.Random)
    name: str = "least_in_flight"

    def choose(self, routes: Sequence[Route], in_flight: InFlight) -> Route:
        loads = [in_flight[route.prefill_addr] + in_flight[route.decode_addr] for route in routes]
        least = min(loads)
        return self.rng.choice([route for route, load in zip(routes, loads, strict=True) if load == least])


POLICIES: dict[str, type[RandomPolicy] | type[LeastInFlightPolicy]] = {
    "random": RandomPolicy, "least_in_flight": LeastInFlightPolicy}


def usable(routes: Sequence[Route], now: float) -> list[Route]:
    """The pairs whose rank-0 nodes both heartbeat within the timeout at ``now`` (epoch seconds)."""
    return [route for route in routes if route.online_until > now]
