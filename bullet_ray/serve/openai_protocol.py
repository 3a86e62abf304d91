"""OpenAI API request bodies (pydantic: schema errors become 422), the features this server refuses (400),
and error bodies.

Unknown fields are accepted (as vLLM does) unless ignoring them would change what the answer means:
those are refused with HTTP 400 naming the field, so a client never gets a 200 that silently skipped a
feature it asked for (`unsupported_parameter`). Fields that only concern billing, storage or latency
(`user`, `store`, `metadata`, `service_tier`, `prediction`, `prompt_cache_key`, `safety_identifier`,
`reasoning_effort`, `parallel_tool_calls` without tools) are accepted and ignored.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool


class StreamOptions(BaseModel):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # vLLM's extra; accepted, usage comes once at the end


def _given(value: Any) -> bool:
    return value is not None


def _truthy(value: Any) -> bool:
    return value is not None and value != [] and value != {} and value != ""


_STRUCTURED = "structured output (guided decoding) is not supported; leave {name} out"

# field -> (is the value asking for something this server does not do?, why and what to send instead).
# Applies to both endpoints; the chat-only entries never appear in a completions body that means them.
_UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "tools": (_truthy, "tools (function calling) are not supported; leave tools out"),
    "tool_choice": (lambda v: v not in (None, "none"),
                    "tool_choice needs tools, which are not supported; leave it out or send 'none'"),
    "functions": (_truthy, "functions (function calling) are not supported; leave functions out"),
    "function_call": (lambda v: v not in (None, "none"),
                      "function_call needs functions, which are not supported; leave it out or send 'none'"),
    "response_format": (lambda v: v is not None and v != {"type": "text"},
                        "only response_format {\"type\": \"text\"} is supported (no JSON mode or JSON schema)"),
    "audio": (_given, "audio output is not supported; leave audio out"),
    "modalities": (lambda v: v not in (None, ["text"]), "only modalities [\"text\"] is supported"),
    "web_search_options": (_given, "web search is not supported; leave web_search_options out"),
    "suffix": (_truthy, "suffix (insertion) is not supported; leave it out"),
    "best_of": (lambda v: v not in (None, 1), "best_of is not supported; use n, or leave best_of out"),
    "guided_json": (_given, _STRUCTURED), "guided_regex": (_given, _STRUCTURED),
    "guided_choice": (_given, _STRUCTURED), "guided_grammar": (_given, _STRUCTURED),
    "structured_outputs": (_given, _STRUCTURED),
}


class UnsupportedParameter(ValueError):
    """A request field asks for a feature this server does not implement. `param` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown fields: see the module docstring

    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (a string key, as JSON has them) -> bias in [-100, 100]
    user: str | None = None
    # vLLM / SGLang extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None

    def sampling_fields(self) -> dict[str, Any]:
        """The body's sampling fields as SamplingParams.from_openai expects them."""
        return self.model_dump(exclude={"model", "n", "stream", "stream_options", "user", "prompt", "messages",
                                        "echo"}, exclude_none=True)

    def check_supported(self) -> None:
        """Raise UnsupportedParameter for the first field that asks for a feature this server lacks."""
        extra = self.model_extra or {}
        for name, (is_unsupported, message) in _UNSUPPORTED.items():
            if name in extra and is_unsupported(extra[name]):
                raise UnsupportedParameter(name, message.replace("{name}", name))
        if self.stream_options is not None and not self.stream:
            raise UnsupportedParameter("stream_options", "stream_options is only allowed with stream=true")

    def ignored_fields(self) -> list[str]:
        """Fields of the body this server accepted without using (logged, never an error)."""
        return sorted(self.model_extra or {})


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise UnsupportedParameter("echo", "echo=true is not supported; send echo=false (or leave it out)")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):  # content parts: only text ones (check_supported refused others)
            return "".join(str(p.get("text", "")) for p in self.content if p.get("type") == "text")
        return self.content or ""


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        check_messages(self.messages)


def check_messages(messages: list[ChatMessage]) -> None:
    """Raise UnsupportedParameter for the first message part this server would drop: a non-text content part, or
    an assistant's tool calls (chat completions and /tokenize alike)."""
    for i, message in enumerate(messages):
        parts = message.content if isinstance(message.content, list) else []
        for j, part in enumerate(parts):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise UnsupportedParameter(
                    f"messages[{i}].content[{j}]", f"only text content parts ({{'type': 'text', 'text': "
                    f"'...'}}) are supported, got type {part.get('type')!r}")
        if (message.model_extra or {}).get("tool_calls"):
            raise UnsupportedParameter(f"messages[{i}].tool_calls",
                                       "tool calls are not supported; send plain text messages")


class TokenizeRequest(BaseModel):
    """vLLM's POST /tokenize: a prompt (text or ids) or chat messages, as the engine would run them."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    # vLLM's switches, accepted at what the engine does (a prompt with its tokenizer's special tokens; messages
    # through the chat template, with the generation prompt and no extra special tokens); other values refused
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None

    def engine_request(self) -> dict[str, Any]:
        """The prompt or the messages in the engine's request form; UnsupportedParameter unless exactly one, for
        a switch the engine does not run that way, and for what chat completions refuse in messages."""
        if (self.prompt is None) == (self.messages is None):
            raise UnsupportedParameter("prompt" if self.prompt is None else "messages",
                                       "send exactly one of prompt and messages")
        chat = self.messages is not None
        if self.add_special_tokens is not None and self.add_special_tokens == chat:
            raise UnsupportedParameter("add_special_tokens", f"the engine runs {'messages' if chat else 'a prompt'} "
                                       f"with add_special_tokens={str(not chat).lower()}; send that or leave it out")
        if self.add_generation_prompt is not None and (not chat or not self.add_generation_prompt):
            raise UnsupportedParameter("add_generation_prompt", "the engine adds the generation prompt to messages "
                                       "(and has none for a prompt); send true with messages or leave it out")
        if self.messages is None:
            return {"prompt": self.prompt}
        check_messages(self.messages)
        return {"messages": [{"role": m.role, "content": m.text()} for m in self.messages]}


class DetokenizeRequest(BaseModel):
    """vLLM's POST /detokenize: token ids back to text."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int]


def error_body(message: str, err_type: str, code: int | str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}
