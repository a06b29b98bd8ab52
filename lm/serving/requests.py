"""The request bodies of the OpenAI API this server speaks, as pydantic models FastAPI validates.

Types are strict (a string is not a number, true is not 1), so a wrong type is a 400 naming the field
before anything reaches the model. Fields of the API this server does not implement are refused when
they ask for something (`logprobs: 5`) and ignored at their neutral value (`presence_penalty: 0`, what
many clients send); fields it does not know at all are ignored, as OpenAI's own server does.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

# name -> its neutral value: anything else asks for what this server does not do.
UNSUPPORTED = {"logprobs": (None, False), "top_logprobs": (None, 0), "echo": (None, False), "best_of": (None, 1),
               "suffix": (None, ""), "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
               "logit_bias": (None, {}), "tools": (None, []), "tool_choice": (None, "none"),
               "response_format": (None, {"type": "text"})}


class Sampled(BaseModel):
    """What both routes share: the model, how to sample, how much, when to stop."""

    model_config = ConfigDict(strict=True, extra="allow")

    model: str
    temperature: float | None = Field(None, ge=0)  # null: 1, OpenAI's default
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=1)
    max_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1, le=16)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None

    def unsupported(self) -> str | None:
        """The first field that asks for something this server does not do, or None."""
        for name, value in (self.model_extra or {}).items():
            if name in UNSUPPORTED and value not in UNSUPPORTED[name]:
                return name
        return None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class CompletionRequest(Sampled):
    """POST /v1/completions: text (or token ids) to continue, one or several prompts."""

    prompt: str | list[str] | list[int] | list[list[int]]


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def as_text(self) -> dict:
        """{role, content} with the content as one string, what chat templates expect."""
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": self.role, "content": text}


class ChatRequest(Sampled):
    """POST /v1/chat/completions: a conversation the model answers."""

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name of max_tokens


CompletionRequest.model_rebuild()
ChatRequest.model_rebuild()

__all__ = ["ChatRequest", "CompletionRequest", "Message"]
