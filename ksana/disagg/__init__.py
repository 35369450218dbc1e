"""Prefill/decode disaggregation: the node agent (router registration, heartbeats, pairs) and the KV transport."""
