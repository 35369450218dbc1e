"""Request bodies of every route, their validation, and OpenAI's error form.

Bodies are parsed with orjson and validated by strict pydantic models (a string where a number belongs is a 400, not
a silent coercion); unknown fields are ignored, as vLLM does. Value ranges are checked by ``SamplingParams`` itself,
so the server and the offline API accept exactly the same values. Every failure becomes an ``APIError`` that renders
as ``{"error": {"message", "type", "param", "code"}}`` with the status the ``openai`` client maps to its exception
classes (400 BadRequestError, 401 AuthenticationError, 404 NotFoundError, 503 InternalServerError).
"""

from __future__ import annotations

import re
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, ValidationError

from ksana.sampling_params import SamplingParams, SamplingParamsError

MAX_LOGPROBS = 20  # vLLM's default max_logprobs: the most top alternatives a client may ask for per token


class APIError(Exception):
    """An error answered to the client in OpenAI's form."""

    def __init__(self, status: int, message: str, *, type: str | None = None, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def service_unavailable(message: str, code: str = "service_unavailable") -> APIError:
    return APIError(503, message, code=code)


def engine_error(message: str) -> APIError:
    """Map a scheduler rejection to its status: a full queue or a timeout is retryable (503), bad input is 400."""
    if "queue is full" in message:
        return service_unavailable(message, code="queue_full")
    if "waiting_timeout" in message or "waited longer" in message:
        return service_unavailable(message, code="timeout")
    if "KV cache" in message:  # prefill/decode: the prompt's K/V did not come, or not whole; another try may
        return service_unavailable(message, code="kv_transfer_failed")
    if "prompt" in message:
        return bad_request(message, param="prompt", code="context_length_exceeded")
    return APIError(500, message, code="internal_error")


def check_content_type(value: str | None) -> None:
    """A body must be declared JSON: ``application/json`` (parameters such as ``charset`` allowed) or
    ``application/*+json``; no Content-Type at all is read as JSON. These are the types vLLM's FastAPI reads as JSON;
    anything else (a form, plain text) is a 415."""
    if value is None:
        return
    media_type = value.split(";", 1)[0].strip().lower()
    if media_type == "application/json" or (media_type.startswith("application/") and media_type.endswith("+json")):
        return
    raise APIError(415, f"the request body must be JSON (Content-Type: application/json), not {value!r}",
                   code="unsupported_media_type")


def parse_body(raw: bytes, model: type[BaseModel]) -> Any:
    """Validate a JSON body against ``model``; malformed JSON and wrong types are 400s naming the field."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        error = exc.errors()[0]
        loc = [str(part) for part in error["loc"]]
        param = loc[0] if loc else None
        where = ".".join(p for p in loc if not _is_type_tag(p)) or "body"
        raise bad_request(f"{where}: {error['msg']}", param=param, code="invalid_type") from None


def _is_type_tag(part: str) -> bool:
    """Pydantic names union members in error locations (``list[int]``, ``str``); they are not field names."""
    return "[" in part or part in ("str", "int", "float", "bool", "dict", "list")


_PARAM_IN_MESSAGE = re.compile(r"sampling parameter '(\w+)'")


def make_sampling_params(**kwargs: Any) -> SamplingParams:
    """``SamplingParams`` with its range errors turned into 400s naming the parameter."""
    try:
        return SamplingParams(**kwargs)
    except SamplingParamsError as exc:
        match = _PARAM_IN_MESSAGE.search(str(exc))
        raise bad_request(str(exc), param=match.group(1) if match else None, code="invalid_value") from None


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool | None = None  # null reads as absent (false), as vLLM reads it
    continuous_usage_stats: bool | None = None


# Sampling fields a request may leave out, with the values they then take when the model's generation config
# (``--generation-config auto``) gives none.
SAMPLING_DEFAULTS: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                                     "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}


class OpenAISampling(_Strict):
    """Fields common to /v1/completions and /v1/chat/completions (OpenAI's, then vLLM's extras)."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    min_tokens: int = 0
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:<id>" (vLLM's option)

    def sampling_kwargs(self, model_defaults: dict[str, Any] | None = None) -> dict[str, Any]:
        """``SamplingParams`` keywords; a field left out takes the model's default, else ``SAMPLING_DEFAULTS``."""
        defaults = SAMPLING_DEFAULTS | {k: v for k, v in (model_defaults or {}).items() if k in SAMPLING_DEFAULTS}
        kwargs = {name: getattr(self, name) if getattr(self, name) is not None else value
                  for name, value in defaults.items()}
        return kwargs | {"n": self.n, "seed": self.seed, "stop": self.stop, "stop_token_ids": self.stop_token_ids,
                         "ignore_eos": self.ignore_eos, "min_tokens": self.min_tokens}

    def check_stream_options(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options can only be set when stream is true", param="stream_options")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(OpenAISampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # null: as many as the context holds
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ContentPart(_Strict):
    type: str
    text: str | None = None


class ChatMessage(_Strict):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.type != "text":
                raise bad_request(f"message content of type {part.type!r} is not supported (only text)",
                                  param="messages")
            parts.append(part.text or "")
        return "".join(parts)


class ChatCompletionRequest(OpenAISampling):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class SamplingConfig(_Strict):
    """KsanaLLM's ``sampling_config`` of /generate (its key names: ``topk``, ``topp``, ``max_new_tokens``, ...)."""

    temperature: float = 1.0
    topk: int | None = None
    topp: float = 1.0
    max_new_tokens: int = -1
    repetition_penalty: float = 1.0
    num_beams: int = 1
    num_return_sequences: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    stop_strings: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int = 0
    do_sample: bool | None = None
    seed: int | None = None
    min_tokens: int = 0
    no_repeat_ngram_size: int = 0


class GenerateRequest(_Strict):
    prompt: str | None = None
    input_tokens: list[int] | None = None
    sampling_config: SamplingConfig = SamplingConfig()
    stream: bool = True
    model_name: str | None = None


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]
