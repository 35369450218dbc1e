"""``LLM``: the offline API, shaped like vLLM's so its users need no manual."""

from __future__ import annotations

import copy
import logging
import random
from collections.abc import Sequence
from typing import Any

import trio
from tqdm.auto import tqdm

from ksana.config import KsanaConfig, load_config
from ksana.engine import InferenceEngine
from ksana.offline_io import OfflineIOActor
from ksana.output_processor import SequenceStream
from ksana.outputs import RequestOutput, prompt_logprobs_output
from ksana.request import InferRequest
from ksana.sampling_params import SamplingParams
from ksana.spec.stats import SpecDecodingStats

logger = logging.getLogger(__name__)

Prompt = str | Sequence[int]


class LLM:
    """``LLM(model="smollm2" | "demo" | PATH, config=YAML, **overrides)``; overrides are config leaf names."""

    def __init__(self, model: str | None = None, config: str | None = None, **overrides: Any) -> None:
        self.config: KsanaConfig = load_config(config, model_dir=model, **overrides)
        self.engine = InferenceEngine(self.config)
        self.tokenizer = self.engine.tokenizer
        self._next_request_id = 0
        self._rng = random.Random()
        self.last_trace = None

    # ---- public API -------------------------------------------------------------------------------------------
    @property
    def spec_decoding_stats(self) -> SpecDecodingStats:
        """Speculative decoding's acceptance over this engine's life so far (all zero while it is off)."""
        return copy.deepcopy(self.engine.scheduler.stats.spec)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt (strings or token-id lists); one result per prompt, in order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # a single prompt
        prompts = list(prompts)
        if sampling_params is None:
            params_list = [SamplingParams()] * len(prompts)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts")

        results: list[RequestOutput] = []
        requests: list[InferRequest] = []
        streams: dict[str, SequenceStream] = {}
        stream_groups: list[list[SequenceStream]] = []
        skip_special = self.config.setting.tokenization.skip_special_tokens
        for prompt, params in zip(prompts, params_list, strict=True):
            if params.stop and self.tokenizer is None:
                raise ValueError("stop strings need a tokenizer; this model directory has none")
            prompt_text, token_ids = self._encode(prompt)
            request_id = self._new_request_id()
            result = RequestOutput(request_id=request_id, prompt=prompt_text, prompt_token_ids=token_ids, outputs=[])
            stream_groups.append([])
            for index, request in enumerate(self._fan_out(request_id, token_ids, params)):
                stream = SequenceStream.create(index, self.tokenizer, token_ids, params, skip_special)
                result.outputs.append(stream.output)
                streams[request.request_id] = stream
                stream_groups[-1].append(stream)
                requests.append(request)
            results.append(result)

        progress = tqdm(total=len(streams), desc="generate", unit="seq", disable=not use_tqdm)
        try:
            trio.run(self._run, requests, streams, progress.update)
        finally:
            progress.close()
        for result, group, params in zip(results, stream_groups, params_list, strict=True):
            result.num_cached_tokens = max(stream.num_cached_tokens for stream in group)
            if params.prompt_logprobs is not None:
                computed = next((s.prompt_logprobs for s in group if s.prompt_logprobs is not None), None)
                if computed is not None:
                    decode = self._token_text if self.tokenizer is not None else None
                    result.prompt_logprobs = prompt_logprobs_output(computed, result.prompt_token_ids, decode)
        for result in results:
            errors = [o.error for o in result.outputs if o.error]
            if errors:
                raise ValueError(f"request {result.request_id} failed: {errors[0]}")
        return results

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | None = None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Apply the model's chat template (with the generation prompt) and generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            list(self.tokenizer.apply_chat_template(conv, add_generation_prompt=True, tokenize=True,
                                                    return_dict=True)["input_ids"])
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    # ---- internals --------------------------------------------------------------------------------------------
    async def _run(self, requests: list[InferRequest], streams: dict[str, SequenceStream], on_finish) -> None:
        io = OfflineIOActor(streams, on_finish=on_finish)
        loop = self.engine.build_loop(io)
        self.last_trace = loop.trace  # the message trace of the latest generate(): Chrome JSON via write_chrome_trace
        async with loop.running():
            await io.submit(requests)
            await io.all_done.wait()

    def _encode(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model directory has no tokenizer: give prompts as token-id lists")
            add_special = self.config.setting.tokenization.add_special_tokens
            return prompt, list(self.tokenizer(prompt, add_special_tokens=add_special)["input_ids"])
        token_ids = [int(t) for t in prompt]
        vocab = self.engine.shape.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        return None, token_ids

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _new_request_id(self) -> str:
        self._next_request_id += 1
        return str(self._next_request_id)

    def _fan_out(self, request_id: str, token_ids: list[int], params: SamplingParams) -> list[InferRequest]:
        """``n`` independent sequences; each gets its own seed (``seed + i`` when seeded)."""
        base_seed = params.seed if params.seed is not None else self._rng.getrandbits(62)
        return [
            InferRequest(
                request_id=request_id if params.n == 1 else f"{request_id}-{i}",
                prompt_token_ids=token_ids,
                sampling_params=params,
                seed=base_seed + i,
                eos_token_ids=self.engine.eos_token_ids,
            )
            for i in range(params.n)
        ]
