"""Request bodies of the OpenAI- and Ollama-compatible routes, validated by pydantic.

Fields follow the public APIs (and vLLM's extensions: top_k, ignore_eos, min_tokens,
stop_token_ids). Optional fields accept null, as OpenAI's do. Unknown fields are ignored, but a
known OpenAI feature pdscope does not implement (logprobs, penalties, tools, ...) is refused when
set to anything but its neutral value: silently ignoring it would return wrong results.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pdscope.engine.sampling_params import SamplingParams


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


SEED_RANGE = {"ge": -(2**63), "lt": 2**64}  # what torch.Generator.manual_seed accepts

# OpenAI parameters pdscope does not implement, with the values that mean "not used".
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "logit_bias": (None, {}),
    "response_format": (None, {"type": "text"}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
}


class _OpenAISampling(_Body):
    model: str | None = None
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    seed: int | None = Field(None, **SEED_RANGE)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unimplemented(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key, neutral in UNSUPPORTED.items():
                if key in data and data[key] not in neutral:
                    raise ValueError(f"'{key}' is not supported by pdscope (got {data[key]!r})")
        return data

    @field_validator("n")
    @classmethod
    def _only_one(cls, n: int | None) -> int | None:
        if n not in (None, 1):
            raise ValueError(f"n={n} is not supported: pdscope returns one choice per request")
        return n

    def sampling(self, max_tokens: int) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k,
            seed=self.seed,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            min_tokens=min(self.min_tokens, max_tokens),
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_OpenAISampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)


class ChatMessage(_Body):
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


class OllamaOptions(_Body):
    num_predict: int | None = None
    temperature: float | None = Field(None, ge=0)
    seed: int | None = Field(None, **SEED_RANGE)
    stop: list[str] | None = None
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)

    def sampling(self, limit: int) -> SamplingParams:
        # Ollama: num_predict -1 (or absent) means "until the context is full"; its default
        # temperature is 0.8 and top_k 40, top_p 0.9.
        n = self.num_predict
        max_tokens = limit if n is None or n < 0 else min(max(n, 1), limit)
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=0.8 if self.temperature is None else self.temperature,
            top_p=0.9 if self.top_p is None else self.top_p,
            top_k=40 if self.top_k is None else self.top_k,
            seed=self.seed,
            stop=list(self.stop or []),
        )


class OllamaGenerateRequest(_Body):
    model: str
    prompt: str = ""
    system: str | None = None
    raw: bool = False
    stream: bool = True
    options: OllamaOptions = Field(default_factory=OllamaOptions)


class OllamaChatRequest(_Body):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool = True
    options: OllamaOptions = Field(default_factory=OllamaOptions)


class OllamaShowRequest(_Body):
    model: str | None = None
    name: str | None = None  # older clients send "name"
