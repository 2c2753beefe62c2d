"""OpenAI request schemas (pydantic), with vLLM's sampling extras and leapfrog's ``speculative``."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator


class _Base(BaseModel):
    # Fields we do not define are kept in ``model_extra`` so that OpenAIServing.check_request can
    # refuse them by name (never ignore them), or accept the ones it does not implement when they
    # hold the value that changes nothing (``tools: []``).
    # Strict types: "0.5" is not a number, 1 is not true, true is not a token id (a 400, never a
    # silent conversion); an integer is still a valid float.
    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False
    continuous_usage_stats: bool = False
    """vLLM: every chunk carries the usage so far (with include_usage)."""


class SpeculativeOptions(BaseModel):
    """Per-request narrowing of the server's speculation (never widening)."""
    model_config = ConfigDict(extra="forbid", strict=True)
    num_speculative_tokens: int = Field(ge=0, description="0 turns speculation off for this request")


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class Prediction(BaseModel):
    """OpenAI's predicted output: ``{"type": "content", "content": str | [text parts]}``."""
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["content"]
    content: str | list[TextPart]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


#: fields OpenAI's API documents as nullable that have a non-null default here: null means that
#: default (as in the OpenAI API and vLLM); clients that send every field, null where unset, work
_NULL_MEANS_DEFAULT = ("n", "stream", "presence_penalty", "frequency_penalty", "echo", "logprobs")


class _Sampling(_Base):
    model_config = ConfigDict(allow_inf_nan=False)   # (with _Base's extra="allow", strict=True)

    @field_validator(*_NULL_MEANS_DEFAULT, mode="before", check_fields=False)
    @classmethod
    def _null_means_default(cls, v: Any, info: ValidationInfo) -> Any:
        """null -> the field's default, before the strict type check (_NULL_MEANS_DEFAULT)."""
        return cls.model_fields[info.field_name].get_default() if v is None else v

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    best_of: int | None = Field(None, ge=1)
    # accepted with no effect on the answer (stored completions, tracing, service options), typed
    # as OpenAI's API types them (a 5 for ``metadata`` is a 400 like any other wrong type)
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    parallel_tool_calls: bool | None = None
    # vLLM extras
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    speculative: SpeculativeOptions | None = None
    prediction: Prediction | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    return_token_ids: bool = False
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and guided_* fields
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)


#: message fields with no effect when null or empty (the openai SDK writes them so)
_EMPTY_OK = ("name", "tool_calls", "tool_call_id", "function_call", "refusal", "annotations", "audio")


class ChatMessage(BaseModel):
    """A message as the chat template sees it: its role and its text. Other message fields
    (``name``, ``tool_calls``, ``tool_call_id``, ...) would change the prompt and are refused."""
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    @model_validator(mode="before")
    @classmethod
    def _empty_fields_not_given(cls, data: Any) -> Any:
        """Fields the openai SDK's ``model_dump()`` writes as null or [] (``tool_calls``,
        ``refusal``, ...) are taken as not given; with a value they are refused."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if not (k in _EMPTY_OK and (v is None or v == []))}
        return data

    @field_validator("content", mode="before")
    @classmethod
    def _parts_are_objects(cls, v: Any) -> Any:
        if isinstance(v, list):   # (a bare string in the list got the union's "content.str" error)
            for i, part in enumerate(v):
                if not isinstance(part, dict):
                    raise ValueError(f"content part {i} must be an object like {{\"type\": \"text\", \"text\": "
                                     f"\"...\"}}, got {type(part).__name__}")
        return v

    @model_validator(mode="after")
    def _content_given(self) -> "ChatMessage":
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        return self

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, v: Any) -> Any:
        """Content parts must be ``{"type": "text", "text": str}``; other kinds, and other keys in
        a part (``cache_control``: refused, never ignored), are refused."""
        if isinstance(v, list):
            for i, part in enumerate(v):
                if part.get("type") != "text":
                    raise ValueError(f"content part {i}: type {part.get('type')!r} is not supported "
                                     "(only 'text' parts)")
                if not isinstance(part.get("text"), str):
                    raise ValueError(f"content part {i}: 'text' must be a string")
                other = sorted(set(part) - {"type", "text"})
                if other:
                    raise ValueError(f"content part {i}: {other[0]!r} is not supported (a text part has "
                                     "'type' and 'text' only)")
        return v


def template_messages(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """Checked messages -> what the chat template reads: role and text (text parts joined by a
    newline, as vLLM joins them). The server and ``LLM.chat`` both render through this."""
    out = []
    for m in messages:
        content = m.content
        if isinstance(content, list):
            content = "\n".join(part["text"] for part in content)   # (vLLM's join)
        out.append({"role": m.role, "content": content or ""})
    return out


def text_chars(messages: list[ChatMessage] | None) -> int:
    """How much text (characters) rendering ``messages`` tokenizes, the template aside."""
    return sum(len(m.content) if isinstance(m.content, str) else
               sum(len(part.get("text", "")) for part in m.content or ()) for m in messages or ())


def check_messages(messages: Any) -> list[ChatMessage]:
    """A conversation from Python (``LLM.chat``) -> checked messages, as the server checks them:
    ValueError naming the message and field (an unknown role or key is refused, not dropped)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("a conversation must be a non-empty list of messages")
    checked = []
    for i, m in enumerate(messages):
        try:
            checked.append(ChatMessage.model_validate(m))
        except ValidationError as e:
            first = e.errors()[0]
            loc = ".".join(str(x) for x in first.get("loc", ()))
            raise ValueError(f"message {i}{': ' + loc if loc else ''}: {first.get('msg')}") from None
    return checked


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    add_generation_prompt: bool = True
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


class TokenizeRequest(_Base):
    """vLLM's /tokenize: a prompt, or chat messages through the chat template."""
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Base):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]
