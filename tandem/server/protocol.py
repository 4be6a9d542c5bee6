"""OpenAI API request bodies (plus vLLM's extras: top_k, min_p, ignore_eos, priority, ...)."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from tandem.core.sampling_params import SamplingParams

PRIORITIES = {"interactive": 1, "standard": 2, "background": 3, 1: 1, 2: 2, 3: 3}


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Base):
    include_usage: bool = False


class _SamplingFields(_Base):
    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    speculative: bool = True  # False: served without speculative decoding
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    priority: Literal["interactive", "standard", "background", 1, 2, 3] | None = None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Raises ValueError naming the bad field."""
        def opt(value, default):
            return default if value is None else value
        return SamplingParams(
            n=self.n, temperature=opt(self.temperature, 1.0), top_p=opt(self.top_p, 1.0),
            top_k=opt(self.top_k, 0), min_p=opt(self.min_p, 0.0), seed=self.seed,
            stop=self.stop or [], stop_token_ids=self.stop_token_ids or [],
            presence_penalty=opt(self.presence_penalty, 0.0), frequency_penalty=opt(self.frequency_penalty, 0.0),
            repetition_penalty=opt(self.repetition_penalty, 1.0), max_tokens=max_tokens,
            min_tokens=self.min_tokens, ignore_eos=self.ignore_eos, logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output, speculative=self.speculative,
        )

    @property
    def priority_level(self) -> int | None:
        """1/2/3, or None to let the engine classify the request by its length."""
        return PRIORITIES[self.priority] if self.priority is not None else None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(default=None, ge=0, le=20)


class ContentPart(_Base):
    type: str
    text: str | None = None


class ChatMessage(_Base):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        if any(p.type != "text" for p in self.content):
            raise ValueError("only text content parts are supported")
        return "".join(p.text or "" for p in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True


class TokenizeRequest(_Base):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(_Base):
    model: str | None = None
    tokens: list[int]
