"""The KV transport of a prefill/decode pair: a gloo group of two over the prefill node's store carries a
prompt's blocks and first token, byte for byte, into the decode node's cache."""

from __future__ import annotations

import threading

import pytest
import torch

from ksana.disagg.kv_connector import KVConnector, KVTransferError
from ksana.messages import KVArrived
from ksana.worker.kv_cache import KVCache
from tests.disagg import wait_for


class _Shape:
    num_layers = 3
    num_kv_heads = 2
    head_dim = 8
    sliding_windows = (None, None, None)


def _connected_pair(expected_bytes=None) -> tuple[KVConnector, KVConnector, list[KVArrived], threading.Event]:
    """A prefill and a decode connector joined in one pair, and the decode side's arrivals as they come."""
    prefill, decode = KVConnector("prefill"), KVConnector("decode")
    decode.expected_bytes = expected_bytes
    arrivals: list[KVArrived] = []
    arrived = threading.Event()
    decode.on_arrival = lambda msg: (arrivals.append(msg), arrived.set())
    comm_id = prefill.comm_id()
    prefill.connect("p__d", comm_id)
    decode.connect("p__d", comm_id)
    wait_for(lambda: prefill.is_connected("p__d") and decode.is_connected("p__d"), "the pair to form")
    return prefill, decode, arrivals, arrived


@pytest.mark.parametrize("head_major", [False, True])
def test_a_prompt_s_blocks_and_first_token_reach_the_decode_cache(head_major):
    prefill, decode, arrivals, arrived = _connected_pair()
    source = KVCache.allocate(_Shape, 8, 4, torch.float32, "cpu", head_major=head_major)
    for k, v in source.layers:
        k.normal_()
        v.normal_()
    target = KVCache.allocate(_Shape, 8, 4, torch.float32, "cpu", head_major=head_major)
    payload = source.gather_blocks((5, 2, 7), 10)  # two full blocks and a partial one
    assert prefill.send("p__d", KVArrived(42, 17, 10, -0.5), payload)
    assert arrived.wait(60)
    assert arrivals == [KVArrived(42, 17, 10, -0.5)]
    received = decode.take(42)
    target.scatter_blocks((0, 3, 1), 10, received.payload)
    for (sk, sv), (tk, tv) in zip(source.layers, target.layers, strict=True):
        assert torch.equal(sk[[5, 2, 7]], tk[[0, 3, 1]])
        assert torch.equal(sv[[5, 2, 7]], tv[[0, 3, 1]])
    wait_for(lambda: prefill.num_sent == 1, "the sender to count its send")  # it counts once the send returns
    assert decode.num_received == 1
    assert decode.bytes_received == payload.numel() == 3 * 4 * 2 * 8 * 4 * 2 * 3
    with pytest.raises(KVTransferError, match="transfer 42"):
        decode.take(42)


def test_a_pair_that_is_not_connected_drops_the_send():
    prefill = KVConnector("prefill")
    assert not prefill.send("p__d", KVArrived(1, 2, 3), torch.zeros(4, dtype=torch.uint8))


def test_kv_that_does_not_fit_this_cache_is_refused_with_a_reason():
    """A peer serving another model or dtype: its bytes are read off the wire and reported, never installed."""
    cache = KVCache.allocate(_Shape, 8, 4, torch.float32, "cpu")
    prefill, decode, arrivals, arrived = _connected_pair(cache.payload_bytes)
    half = KVCache.allocate(_Shape, 8, 4, torch.bfloat16, "cpu").gather_blocks((0, 1), 6)
    assert half.numel() * 2 == cache.payload_bytes(6)
    assert prefill.send("p__d", KVArrived(5, 17, 6), half)
    assert arrived.wait(60)
    (msg,) = arrivals
    assert msg.transfer_id == 5 and "does not fit" in msg.error and "different models or dtypes" in msg.error
    with pytest.raises(KVTransferError):
        decode.take(5)
