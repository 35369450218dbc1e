"""Ksana: an event-driven LLM inference engine with paged KV cache, continuous batching and perf simulation."""

from ksana.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # LLM pulls in torch and transformers; import it only when asked for.
    if name == "LLM":
        from ksana.llm import LLM

        return LLM
    raise AttributeError(name)
