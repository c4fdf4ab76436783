"""The OpenAI API's shapes: request bodies (pydantic, strict: a field of the wrong type or one the
server does not know is an error, never ignored), response and stream-chunk bodies, and the error
body `{"error": {"message", "type", "param", "code"}}`.

Requests follow OpenAI's fields and defaults (temperature 1, top_p 1, completions' max_tokens
16; a field sent as null is a field left out); `top_k`, `stop_token_ids` and
`repetition_penalty` are extensions as vLLM spells them.
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

# The most stop strings a request may give (OpenAI's limit).
MAX_STOP_STRINGS = 4
# The most alternatives per token: completions' logprobs, chat's top_logprobs (OpenAI's limits).
MAX_COMPLETION_LOGPROBS, MAX_TOP_LOGPROBS = 5, 20


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
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    repetition_penalty: float = Field(default=1.0, gt=0)
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # OpenAI's end-user tag; accepted, not used

    @model_validator(mode="before")
    @classmethod
    def _null_is_left_out(cls, body):
        """A field sent as null takes its default, as if left out (OpenAI's fields are
        nullable: clients send `"temperature": null`)."""
        if isinstance(body, dict):
            return {k: v for k, v in body.items() if v is not None}
        return body

    @field_validator(
        "temperature", "top_p", "frequency_penalty", "presence_penalty", "repetition_penalty",
        mode="before",
    )  # fmt: skip
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


def _ids(x) -> bool:
    return isinstance(x, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in x)


class CompletionRequest(_Sampled):
    """POST /v1/completions: `prompt` is text (sent as is, no chat template) or token ids, or a
    list of either (one choice per prompt, n each). `echo` puts the prompt before each answer
    (and with `logprobs` the prompt's own logprobs before the answer's); max_tokens 0 is served
    with echo only."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int = Field(default=16, ge=0)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)

    @field_validator("max_tokens", mode="before")
    @classmethod
    def _default_tokens(cls, n):
        return 16 if n is None else n

    @field_validator("prompt", mode="before")
    @classmethod
    def _text_or_ids(cls, prompt):
        many = isinstance(prompt, list) and prompt and all(
            isinstance(p, str) or (isinstance(p, list) and _ids(p)) for p in prompt
        )  # fmt: skip
        if not (isinstance(prompt, str) or _ids(prompt) or many):
            raise ValueError(
                f"must be a string, a list of token ids, or a list of either, got {prompt!r:.80}"
            )
        if prompt == []:
            raise ValueError("the list of token ids is empty")
        if many and any(p == [] for p in prompt):
            raise ValueError("a list of token ids is empty")
        return prompt

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts, one or several."""
        if isinstance(self.prompt, str) or _ids(self.prompt):
            return [self.prompt]
        return list(self.prompt)


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
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

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
    """Builds one request's response or stream chunks (an id and creation time shared by all).
    `token_text(id)` is a token's own text (for logprobs)."""

    def __init__(self, *, chat: bool, model: str, token_text=str):
        self.chat, self.model, self.token_text = chat, model, token_text
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def logprobs(self, entries, top: int, offset: int = 0) -> dict[str, Any] | None:
        """entries: [(token id, Logprob or None)] -> OpenAI's logprobs object: chat's
        {"content": [{token, logprob, bytes, top_logprobs: `top` of them}]}, or completions'
        {tokens, token_logprobs, top_logprobs: {text: logprob} of the `top` most likely and
        the token itself, text_offset from `offset`} (None where nothing predicts the token:
        an echoed prompt's first)."""
        text = self.token_text
        if self.chat:

            def one(token, logprob):
                t = text(token)
                return {"token": t, "logprob": logprob, "bytes": list(t.encode("utf-8"))}

            content = [
                one(lp.token, lp.logprob)
                | {"top_logprobs": [one(i, x) for i, x in lp.top[:top]]}
                for _, lp in entries
            ]  # fmt: skip
            return {"content": content, "refusal": None}
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, lp in entries:
            t = text(token)
            out["tokens"].append(t)
            out["text_offset"].append(offset)
            offset += len(t)
            if lp is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(lp.logprob)
            best = {text(i): x for i, x in lp.top[:top]}
            out["top_logprobs"].append(best | {t: lp.logprob} if t not in best else best)
        return out

    def choice(self, index: int, text: str, finish_reason: str, logprobs=None) -> dict[str, Any]:
        """One choice of a whole response (`logprobs` as `self.logprobs` makes it, or None)."""
        if self.chat:
            choice = {"index": index, "message": {"role": "assistant", "content": text}}
        else:
            choice = {"index": index, "text": text}
        return choice | {"logprobs": logprobs, "finish_reason": finish_reason}

    def full(self, choices: list[dict], prompt_tokens: int, completion_tokens: int):
        head = self._head("chat.completion" if self.chat else "text_completion")
        return head | {"choices": choices, "usage": _usage(prompt_tokens, completion_tokens)}

    def chunk(self, index: int, text: str | None, finish_reason: str | None = None, *,
              first=False, logprobs=None):  # fmt: skip
        """A stream chunk of choice `index`: new text, or (text None) its last chunk with the
        finish reason."""
        if self.chat:
            delta = {} if text is None else {"content": text}
            if first:
                delta = {"role": "assistant", **delta}
            choice = {"index": index, "delta": delta}
            head = self._head("chat.completion.chunk")
        else:
            choice = {"index": index, "text": text or ""}
            head = self._head("text_completion")
        choice |= {"logprobs": logprobs, "finish_reason": finish_reason}
        return head | {"choices": [choice]}

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int):
        """stream_options.include_usage: the chunk after the last, with no choices."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return self._head(obj) | {"choices": [], "usage": _usage(prompt_tokens, completion_tokens)}
