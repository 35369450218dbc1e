"""One node's end of its prefill/decode pairs' KV transport: a torch.distributed process group per pair.

A pair of nodes with ``T`` tensor-parallel ranks each is a gloo group of ``2T`` ranks, the prefill node's ranks
``0..T-1`` and the decode node's ``T..2T-1``, built on a TCPStore that the prefill node's rank 0 hosts; each rank
sends its own KV heads to the matching rank of the peer (``r`` to ``T + r``); the store's ``host:port`` and a fresh nonce (``host:port/nonce``, so a pair formed
again after a node restarts never meets the old pair's keys) make the pair's comm id, which the prefill node
registers with the router (``/RegisterCommId``) and the decode node reads from its heartbeat answer. Each transfer is two
point-to-point messages: a header (transfer id, first token, prompt length, payload bytes, first token's
logprob) and the payload, the prompt's blocks of every layer's keys and values as bytes.

Sends and receives block, so they run on threads of their own: a sender per pair drains a queue the worker fills
after a step (the worker copies the blocks out first, so the step's blocks can be freed and reused at once), and a
receiver per pair on a decode node files what comes into the inbox; rank 0's reports it (``on_arrival``) for the
worker actor to tell the scheduler. The install step takes it from the inbox (a rank other than 0 waits for its
own share there, which comes at about the same time).
"""

from __future__ import annotations

import datetime
import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable

import attrs
import torch
import torch.distributed as dist

from ksana.messages import KVArrived

logger = logging.getLogger(__name__)

_HEADER_TAG, _PAYLOAD_TAG = 0, 1
_HEADER_LEN = 5  # transfer id, first token, prompt tokens, payload bytes, first token's logprob


class KVTransferError(RuntimeError):
    """A received prompt's K/V is missing or does not fit this node's cache."""


@attrs.define
class ReceivedKV:
    transfer_id: int
    first_token: int
    num_tokens: int
    payload: torch.Tensor  # uint8
    received_at: float


@attrs.define
class _Pair:
    comm_key: str
    comm_id: str
    rank: int  # in the pair's group
    peer: int
    group: dist.ProcessGroup | None = None
    outbox: queue.Queue = attrs.field(factory=queue.Queue)
    ready: threading.Event = attrs.field(factory=threading.Event)
    broken: bool = False


class KVConnector:
    """``role``: "prefill" or "decode"; ``tp_rank`` of ``tp_size``: this process's tensor-parallel rank.
    ``expire_s``: received K/V that no install takes within this long is dropped (its request ended or never
    came)."""

    def __init__(self, role: str, host: str = "127.0.0.1", expire_s: float = 30.0, timeout_s: float = 600.0,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        self.role = role
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.host = host
        self.expire_s = expire_s
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.on_arrival: Callable[[KVArrived], None] | None = None
        # The bytes a prompt of so many tokens takes in this node's cache (``KVCache.payload_bytes``): K/V of
        # another size (a peer serving another model or dtype) is refused, not installed.
        self.expected_bytes: Callable[[int], int] | None = None
        self.pairs: dict[str, _Pair] = {}
        self._inbox: dict[int, ReceivedKV] = {}
        self._lock = threading.Condition()
        self._store: dist.TCPStore | None = None
        self.num_sent = self.num_received = self.bytes_sent = self.bytes_received = 0
        self.send_seconds = 0.0

    # ---- pairing ----------------------------------------------------------------------------------------------
    def comm_id(self) -> str:
        """A new comm id for a pair of this prefill node: its store's address (hosted on first use) and a
        nonce."""
        if self._store is None:
            self._store = dist.TCPStore(self.host, 0, None, is_master=True, wait_for_workers=False,
                                        timeout=self.timeout)
        return f"{self.host}:{self._store.port}/{secrets.token_hex(4)}"

    def connect(self, comm_key: str, comm_id: str) -> None:
        """Join the pair ``comm_key`` over the store at ``comm_id`` (both nodes call it; the group forms once both
        have). Idempotent for one comm id; a new one replaces the pair."""
        pair = self.pairs.get(comm_key)
        if pair is not None and pair.comm_id == comm_id:
            return
        if pair is not None:
            pair.outbox.put(None)  # ends the replaced pair's sender
        prefill_rank, decode_rank = self.tp_rank, self.tp_size + self.tp_rank
        pair = (_Pair(comm_key, comm_id, prefill_rank, decode_rank) if self.role == "prefill" else
                _Pair(comm_key, comm_id, decode_rank, prefill_rank))
        self.pairs[comm_key] = pair
        threading.Thread(target=self._run_pair, args=(pair, comm_id), name=f"ksana-kv-{comm_key}",
                         daemon=True).start()

    def is_connected(self, comm_key: str) -> bool:
        pair = self.pairs.get(comm_key)
        return pair is not None and pair.ready.is_set() and not pair.broken

    def _run_pair(self, pair: _Pair, comm_id: str) -> None:
        try:
            address, nonce = comm_id.rsplit("/", 1)
            host, port = address.rsplit(":", 1)
            store = (self._store if self._store is not None else
                     dist.TCPStore(host, int(port), None, is_master=False, timeout=self.timeout))
            prefixed = dist.PrefixStore(f"ksana/pd/{pair.comm_key}/{nonce}", store)
            options = dist.ProcessGroupGloo._Options()
            options._timeout = self.timeout
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=self.host)]
            pair.group = dist.ProcessGroupGloo(prefixed, pair.rank, 2 * self.tp_size, options)
            pair.ready.set()
            logger.info("KV pair %s connected (rank %d)", pair.comm_key, pair.rank)
            if self.role == "prefill":
                self._send_loop(pair)
            else:
                self._receive_loop(pair)
        except Exception as exc:  # noqa: BLE001 - a vanished peer ends the pair, never the node
            pair.broken = True
            logger.warning("KV pair %s closed: %s", pair.comm_key, exc)

    # ---- prefill node -----------------------------------------------------------------------------------------
    def send(self, comm_key: str, arrived: KVArrived, payload: torch.Tensor) -> bool:
        """Queue one prompt's K/V for the decode peer; False (and nothing sent) when the pair is not connected."""
        pair = self.pairs.get(comm_key)
        if pair is None or pair.broken or not pair.ready.is_set():
            logger.warning("KV for transfer %d dropped: pair %s is not connected", arrived.transfer_id, comm_key)
            return False
        pair.outbox.put((arrived, payload))
        return True

    def _send_loop(self, pair: _Pair) -> None:
        while True:
            item = pair.outbox.get()
            if item is None:
                return
            arrived, payload = item
            started = time.perf_counter()
            header = torch.tensor([arrived.transfer_id, arrived.first_token, arrived.num_tokens, payload.numel(),
                                   arrived.logprob], dtype=torch.float64)
            pair.group.send([header], pair.peer, _HEADER_TAG).wait()
            pair.group.send([payload], pair.peer, _PAYLOAD_TAG).wait()
            self.send_seconds += time.perf_counter() - started
            self.num_sent += 1
            self.bytes_sent += payload.numel()

    # ---- decode node ------------------------------------------------------------------------------------------
    def _receive_loop(self, pair: _Pair) -> None:
        while True:
            header = torch.empty(_HEADER_LEN, dtype=torch.float64)
            pair.group.recv([header], pair.peer, _HEADER_TAG).wait()
            transfer_id, first_token, num_tokens, num_bytes = (int(v) for v in header[:4].tolist())
            payload = torch.empty(num_bytes, dtype=torch.uint8)
            pair.group.recv([payload], pair.peer, _PAYLOAD_TAG).wait()
            expected = self.expected_bytes(num_tokens) if self.expected_bytes is not None else num_bytes
            if num_bytes != expected:
                logger.warning("KV of transfer %d refused: %d bytes where this cache takes %d", transfer_id,
                               num_bytes, expected)
                if self.on_arrival is not None:
                    self.on_arrival(KVArrived(transfer_id, first_token, num_tokens, error=(
                        f"the prefill node's KV cache ({num_bytes} bytes for {num_tokens} tokens) does not fit "
                        f"this node's ({expected} bytes): the pair serves different models or dtypes")))
                continue
            now = time.monotonic()
            with self._lock:
                for tid in [t for t, kv in self._inbox.items() if now - kv.received_at > self.expire_s]:
                    del self._inbox[tid]
                self._inbox[transfer_id] = ReceivedKV(transfer_id, first_token, num_tokens, payload, now)
                self._lock.notify_all()
            self.num_received += 1
            self.bytes_received += num_bytes
            if self.on_arrival is not None:
                self.on_arrival(KVArrived(transfer_id, first_token, num_tokens, float(header[4])))

    def take(self, transfer_id: int, wait_s: float = 0.0) -> ReceivedKV:
        """The received K/V of ``transfer_id``, waiting up to ``wait_s`` for it (a rank other than 0)."""
        with self._lock:
            self._lock.wait_for(lambda: transfer_id in self._inbox, timeout=wait_s)
            received = self._inbox.pop(transfer_id, None)
        if received is None:
            raise KVTransferError(f"no received KV cache for transfer {transfer_id}")
        return received
