"""Request bodies of the OpenAI- and Ollama-compatible routes, validated by pydantic.

Fields follow the public APIs (and vLLM's extensions: top_k, ignore_eos, min_tokens,
stop_token_ids). Optional fields accept null, as OpenAI's do. Unknown fields are ignored, but a
known OpenAI feature pdscope does not implement (logprobs, penalties, tools, ...) is refused when
set to anything but its neutral value: silently ignoring it would return wrong results.

Validation is strict (no "5" for 5, no 1 for true), so what the published OpenAPI schema calls
invalid is refused with a 400, and every text field refuses lone surrogates (``"\\ud800"``
escapes) that no tokenizer can take.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from pdscope.engine.sampling_params import SamplingParams


def _no_lone_surrogates(text: str) -> str:
    if text.isascii():  # O(1) in CPython (a flag of the string); encoding copies the text
        return text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"text holds a lone UTF-16 surrogate ({text[exc.start]!r} at character "
            f"{exc.start}); send valid Unicode"
        ) from None
    return text


def _integral(value: Any) -> Any:
    # JSON Schema counts 2.0 as an integer; so does this server (and nothing else as one).
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# Integer types carry their bounds inside, so that the published schema shows them.
Int = Annotated[int, BeforeValidator(_integral)]
NonNegative = Annotated[int, Field(ge=0), BeforeValidator(_integral)]
Text = Annotated[str, AfterValidator(_no_lone_surrogates)]
NonEmptyText = Annotated[str, Field(min_length=1), AfterValidator(_no_lone_surrogates)]


def _integral_items(value: Any) -> Any:
    # One pass over the list, not one validator call per id: a million ids validate in a
    # fraction of the time.
    if isinstance(value, list):
        return [int(v) if type(v) is float and v.is_integer() else v for v in value]
    return value


TokenId = Annotated[int, Field(ge=0, json_schema_extra={"x-pdscope": "token-id"})]
IdList = Annotated[list[TokenId], BeforeValidator(_integral_items)]
# "developer" is OpenAI's newer name for "system" (its clients send it); templates get "system".
Role = Literal["system", "developer", "user", "assistant", "tool"]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Body):
    include_usage: bool | None = True  # vLLM's default: {} asks for the usage chunk


# What torch.Generator.manual_seed accepts; the bounds go into the schema as exact integers.
Seed = Annotated[
    int,
    Field(ge=-(2**63), le=2**64 - 1, json_schema_extra={"x-pdscope": "seed"}),
    BeforeValidator(_integral),
]

# OpenAI parameters pdscope does not implement, with the values that mean "not used".
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, False),  # 0 still asks for the sampled token's logprob
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
    model: Text | None = None
    temperature: float | None = Field(None, ge=0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: Annotated[int, Field(ge=-1), BeforeValidator(_integral)] | None = None
    seed: Seed | None = None
    stop: NonEmptyText | list[NonEmptyText] | None = None
    stop_token_ids: IdList | None = None
    ignore_eos: bool = False
    # bounded in the schema as max_tokens is: never more than the context's room
    min_tokens: Annotated[
        int, Field(ge=0, json_schema_extra={"x-pdscope": "max-tokens"}), BeforeValidator(_integral)
    ] = 0
    n: Annotated[Literal[1], BeforeValidator(_integral)] | None = None
    stream: bool | None = False  # null: the default
    # Without a stream it asks for nothing missing (a whole response carries its usage), so it
    # is taken, where vLLM and OpenAI refuse it: the published schema (and schemathesis with
    # it) would call such a refusal of a schema-valid body a bug.
    stream_options: StreamOptions | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unimplemented(cls, data: Any) -> Any:
        return _refuse(data, UNSUPPORTED, "")

    @field_validator("n", mode="wrap")
    @classmethod
    def _only_one(cls, n: Any, handler: Any) -> int | None:
        try:
            return handler(n)
        except ValueError:
            raise ValueError(
                f"n={n!r} is not supported: pdscope returns one choice per request"
            ) from None

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
            min_tokens=self._min_tokens(max_tokens),
        )

    def _min_tokens(self, max_tokens: int) -> int:
        if self.min_tokens > max_tokens:  # vLLM refuses it too; it was cut to max_tokens
            raise FieldError(
                "min_tokens",
                f"min_tokens {self.min_tokens} is more than max_tokens {max_tokens} (the "
                "output allowed: max_tokens as given, else the context's room)",
            )
        return self.min_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


MaxTokens = Annotated[
    int, Field(ge=1, json_schema_extra={"x-pdscope": "max-tokens"}), BeforeValidator(_integral)
]
TokenIds = Annotated[IdList, Field(min_length=1, json_schema_extra={"x-pdscope": "prompt-ids"})]


class CompletionRequest(_OpenAISampling):
    # One prompt per request: a list holds token ids, or exactly one text or id list.
    prompt: (
        NonEmptyText
        | TokenIds
        | Annotated[list[NonEmptyText], Field(min_length=1, max_length=1)]
        | Annotated[list[TokenIds], Field(min_length=1, max_length=1)]
    )
    max_tokens: MaxTokens | None = 16


class TextPart(_Body):
    """A chat content part; only text parts exist for a text-only model."""

    type: Literal["text"]
    text: Text


class ChatMessage(_Body):
    role: Role
    content: Text | list[TextPart] | None = None


class ChatCompletionRequest(_OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None


class TokenizeChat(_Body):
    model: Text | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True


class TokenizePrompt(_Body):
    model: Text | None = None
    prompt: Text
    add_special_tokens: bool = True


# vLLM's two shapes of /tokenize; a body with both fields is read as chat.
TokenizeRequest = Annotated[TokenizeChat | TokenizePrompt, Field(union_mode="left_to_right")]


class DetokenizeRequest(_Body):
    model: Text | None = None
    tokens: IdList


# Ollama fields pdscope does not implement, with the values that mean "not used". Ollama
# itself refuses format, images, tools and think for a model without them; an option that
# changes sampling (penalties, mirostat, min_p) is refused unless neutral. Runtime knobs
# (num_thread, num_batch, use_mmap, ...) are ignored, as they change no result.
OLLAMA_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "format": (None, ""),
    "images": (None, []),
    "tools": (None, []),
    "think": (None, False),
    "template": (None, ""),
    "suffix": (None, ""),
    "context": (None, []),
}
OLLAMA_UNSUPPORTED_OPTIONS: dict[str, tuple[Any, ...]] = {
    "repeat_penalty": (None, 1, 1.0),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "mirostat": (None, 0),
    "min_p": (None, 0, 0.0),
    "typical_p": (None, 1, 1.0),
    "tfs_z": (None, 1, 1.0),
}


class FieldError(ValueError):
    """A refusal that names its field: the 400's ``param`` (a model-level check has none)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def _same(value: Any, neutral: Any) -> bool:
    return value == neutral and isinstance(value, bool) == isinstance(neutral, bool)


def _refuse(data: Any, unsupported: dict[str, tuple[Any, ...]], where: str) -> Any:
    if isinstance(data, dict):
        for key, neutral in unsupported.items():
            # 0 == False in Python, but logprobs 0 asks for something and false does not
            if key in data and not any(_same(data[key], n) for n in neutral):
                raise FieldError(
                    f"{where}{key}",
                    f"'{where}{key}' is not supported by pdscope (got {data[key]!r})",
                )
    return data


class OllamaOptions(_Body):
    num_predict: Int | None = None
    # The request's context window, capped by the server's --max-model-len (ollama_api._respond).
    num_ctx: Annotated[int, Field(ge=1), BeforeValidator(_integral)] | None = None
    temperature: float | None = Field(None, ge=0, allow_inf_nan=False)
    seed: Seed | None = None
    stop: list[NonEmptyText] | None = None
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: NonNegative | None = None

    def sampling(self, limit: int) -> SamplingParams:
        # Ollama: num_predict -1 (or absent) and 0 set no limit (its runners stop at one only
        # above 0); here output stops when the context is full, where Ollama shifts its cache
        # and goes on unless shift is false. Its default temperature is 0.8, top_k 40, top_p 0.9.
        n = self.num_predict
        max_tokens = limit if n is None or n <= 0 else min(n, limit)
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=0.8 if self.temperature is None else self.temperature,
            top_p=0.9 if self.top_p is None else self.top_p,
            top_k=40 if self.top_k is None else self.top_k,
            seed=self.seed,
            stop=list(self.stop or []),
        )

    @model_validator(mode="before")
    @classmethod
    def _refuse_unimplemented(cls, data: Any) -> Any:
        return _refuse(data, OLLAMA_UNSUPPORTED_OPTIONS, "options.")


class _OllamaBody(_Body):
    @model_validator(mode="before")
    @classmethod
    def _refuse_unimplemented(cls, data: Any) -> Any:
        messages = data.get("messages") if isinstance(data, dict) else None
        for i, message in enumerate(messages if isinstance(messages, list) else []):
            _refuse(message, {"images": (None, [])}, f"messages.{i}.")
        return _refuse(data, OLLAMA_UNSUPPORTED, "")


class _OllamaRun(_OllamaBody):
    # null reads as absent, as Ollama's Go types take it: a stream, default options
    stream: bool | None = True
    options: OllamaOptions | None = None

    @property
    def streams(self) -> bool:
        return self.stream is not False

    @property
    def run_options(self) -> OllamaOptions:
        return self.options or OllamaOptions()


class OllamaGenerateRequest(_OllamaRun):
    model: Text
    prompt: Text | None = ""  # empty or null: load the model
    system: Text | None = None
    raw: bool | None = False


class OllamaChatRequest(_OllamaRun):
    model: Text
    messages: list[ChatMessage] | None = None  # none, empty or null: load the model


class OllamaShowRequest(_Body):
    model: Text | None = None
    name: Text | None = None  # older clients send "name"
