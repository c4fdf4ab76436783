"""The OpenAI API's shapes: request bodies (pydantic, strict: a field of the wrong type or one the
server does not know is an error, never ignored), response and stream-chunk bodies, and the error
body `{"error": {"message", "type", "param", "code"}}`.

Requests follow OpenAI's fields and defaults (temperature 1, top_p 1, completions' max_tokens
16; a field sent as null is a field left out); `top_k` and `stop_token_ids` are extensions as
vLLM spells them; only n = 1 is served.
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

# The most stop strings a request may give (OpenAI's limit).
MAX_STOP_STRINGS = 4


class APIError(Exception):
    """An answer other than 200, with OpenAI's error body."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers=None):  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    include_usage: bool = False


def _finite(x):
    """A number that is not NaN or infinite (JSON's NaN, Infinity and 1e309 parse as floats)."""
    if isinstance(x, float) and not math.isfinite(x):
        name = "NaN" if math.isnan(x) else "Infinity" if x > 0 else "-Infinity"
        raise ValueError(f"must be a finite number, got {name}")
    return x


class _Sampled(BaseModel):
    """The fields both endpoints share."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: str | None = None  # None: the one model served
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=1)
    seed: int | None = Field(default=None, ge=0, lt=2**32)  # None: a fresh random seed
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = []
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # OpenAI's end-user tag; accepted, not used

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError(f"only n = 1 is served, got {n}")
        return n

    @field_validator("temperature", "top_p", mode="before")
    @classmethod
    def _finite_number(cls, x):
        return _finite(x)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_strings(cls, stop):
        if isinstance(stop, list) and len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
        strings = stop if isinstance(stop, list) else [stop]
        if not all(isinstance(x, str) for x in strings if x is not None):
            raise ValueError("must be a string or a list of strings")
        if "" in strings:
            raise ValueError("a stop string must not be empty")
        return stop

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampled):
    """POST /v1/completions: `prompt` is text (sent as is, no chat template) or token ids."""

    prompt: str | list[int]
    max_tokens: int = Field(default=16, ge=1)

    @field_validator("max_tokens", mode="before")
    @classmethod
    def _default_tokens(cls, n):
        return 16 if n is None else n

    @field_validator("prompt", mode="before")
    @classmethod
    def _text_or_ids(cls, prompt):
        ids = isinstance(prompt, list) and all(
            isinstance(i, int) and not isinstance(i, bool) for i in prompt
        )
        if not (isinstance(prompt, str) or ids):
            raise ValueError(f"must be a string or a list of token ids, got {prompt!r:.80}")
        if prompt == []:
            raise ValueError("the list of token ids is empty")
        return prompt


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None  # the participant's name, handed to the chat template

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Sampled):
    """POST /v1/chat/completions: `messages` rendered by the tokenizer's chat template. Without
    max_tokens (or its newer name max_completion_tokens) the answer may fill the slot."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = Field(default=None, ge=1)

    @property
    def answer_limit(self) -> int | None:
        return self.max_tokens if self.max_tokens is not None else self.max_completion_tokens


def parse(model: type[BaseModel], body: bytes):
    """The request body as `model`, or APIError 400 naming the first problem and its field."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        if err["type"] == "json_invalid":
            raise APIError(400, f"the body is not valid JSON: {err['msg']}") from None
        # loc: the field, then the union member tried ('str', 'list[int]'), list indices
        fields = [str(p) for p in err["loc"] if isinstance(p, int) or p.isidentifier()]
        fields = [p for p in fields if p not in ("str", "list", "int", "float")]
        param = ".".join(fields) or None
        where = f"{param}: " if param else ""
        if err["type"] == "missing":
            raise APIError(400, f"{where}the field is required", param=param) from None
        if err["type"] == "extra_forbidden":
            raise APIError(400, f"{where}unknown or unsupported field", param=param) from None
        if err["type"] == "value_error":  # a validator's own message, without pydantic's prefix
            raise APIError(400, f"{where}{err['ctx']['error']}", param=param) from None
        raise APIError(400, f"{where}{err['msg']}", param=param) from None


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class Reply:
    """Builds one request's response or stream chunks (an id and creation time shared by all)."""

    def __init__(self, *, chat: bool, model: str):
        self.chat, self.model = chat, model
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(self, text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int):
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}}
            head = self._head("chat.completion")
        else:
            choice = {"index": 0, "text": text}
            head = self._head("text_completion")
        choice |= {"logprobs": None, "finish_reason": finish_reason}
        return head | {"choices": [choice], "usage": _usage(prompt_tokens, completion_tokens)}

    def chunk(self, text: str | None, finish_reason: str | None = None, *, first=False):
        """A stream chunk: new text, or (text None) the last chunk with the finish reason."""
        if self.chat:
            delta = {} if text is None else {"content": text}
            if first:
                delta = {"role": "assistant", **delta}
            choice = {"index": 0, "delta": delta}
            head = self._head("chat.completion.chunk")
        else:
            choice = {"index": 0, "text": text or ""}
            head = self._head("text_completion")
        choice |= {"logprobs": None, "finish_reason": finish_reason}
        return head | {"choices": [choice]}

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int):
        """stream_options.include_usage: the chunk after the last, with no choices."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return self._head(obj) | {"choices": [], "usage": _usage(prompt_tokens, completion_tokens)}
