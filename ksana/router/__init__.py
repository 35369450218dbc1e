"""The Simple Router: registers prefill and decode nodes, pairs them, and proxies requests to a pair."""
