"""The OpenAI-compatible streaming server and KsanaLLM's native /generate API."""
