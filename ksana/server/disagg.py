"""Requests a prefill/decode pair serves together (``ksana serve --role prefill|decode``).

The router sends the same body to both nodes with two headers: ``kv-comm-group-key`` (the pair,
``"<prefill addr>__<decode addr>"``) and ``kv-comm-request-id`` (the request's id on both nodes). The route reads
them into ``KV_TRANSFER`` (a context variable, so the handlers below the route need no new parameter) and the
generation tags its request with it: a prefill node computes the prompt and the first token only, then sends
the K/V; a decode node waits for that K/V and streams from the first token on. A node without a role, or a
request without the headers, is served as a standalone server would.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextvars import ContextVar

import attrs

from ksana.messages import KVTransfer
from ksana.router.protocol import KV_COMM_GROUP_KEY, KV_COMM_REQUEST_ID, split_comm_key
from ksana.sampling_params import SamplingParams
from ksana.server.protocol import bad_request

KV_TRANSFER: ContextVar[KVTransfer | None] = ContextVar("kv_transfer", default=None)


def kv_transfer_from_headers(headers: Mapping[str, str], role: str) -> KVTransfer | None:
    """The request's pair and id on a prefill or decode node; None for a standalone request."""
    key, request_id = headers.get(KV_COMM_GROUP_KEY), headers.get(KV_COMM_REQUEST_ID)
    if role == "none" or key is None or request_id is None:
        return None
    try:
        transfer_id = int(request_id)
    except ValueError:
        transfer_id = -1
    if not 0 < transfer_id < 2**31:
        raise bad_request(f"header {KV_COMM_REQUEST_ID} must be an integer in [1, 2^31), got {request_id!r}")
    if split_comm_key(key) is None:
        raise bad_request(f"header {KV_COMM_GROUP_KEY} must be '<prefill addr>__<decode addr>', got {key!r}")
    return KVTransfer(role=role, comm_key=key, transfer_id=transfer_id)


def pair_params(kv: KVTransfer, params: SamplingParams, num_sequences: int, beam: bool) -> SamplingParams:
    """The sampling parameters a pair's node runs with: one sequence, and on the prefill node the first token
    only (the decode node produces the rest)."""
    if beam or num_sequences != 1:
        raise bad_request("a prefill/decode pair serves one sequence per request (no n > 1, best_of or beam "
                          "search)")
    if params.prompt_logprobs is not None:
        raise bad_request("a prefill/decode pair does not compute prompt logprobs (echo with logprobs)")
    if kv.role == "prefill":
        return attrs.evolve(params, max_tokens=1, min_tokens=0)
    return params
