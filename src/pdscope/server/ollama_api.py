"""Ollama-compatible routes: generate and chat (NDJSON streams), tags, version, show.

The final object's counters and durations (nanoseconds) come from the engine's timeline with
Ollama's meanings:
* ``prompt_eval_count``: the whole prompt, cached tokens included (as recent Ollama reports it);
* ``prompt_eval_duration``: first scheduled to first token, the uncached prefill only;
* ``eval_count``: every output token; ``eval_duration``: first token to last token (0 for a
  single token, as with ``num_predict: 1``: it came out of prefill, no decode step followed);
* ``total_duration``: arrival to finish; ``load_duration``: 0, the model stays loaded.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from pdscope import __version__
from pdscope.engine.async_engine import EngineDeadError
from pdscope.engine.llm_engine import RequestOutput
from pdscope.server.common import (
    APIError,
    Dialect,
    ServerState,
    TextDeltas,
    collect,
    ndjson,
    state_of,
)
from pdscope.server.protocol import (
    ChatMessage,
    OllamaChatRequest,
    OllamaGenerateRequest,
    OllamaOptions,
    OllamaShowRequest,
)

router = APIRouter()


def _now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def _ns(seconds: float | None) -> int:
    return 0 if seconds is None else max(0, round(seconds * 1e9))


def final_counters(out: RequestOutput) -> dict[str, Any]:
    t = out.timeline
    return {
        "done": True,
        "done_reason": out.finish_reason,
        "total_duration": _ns(t.e2e_s),
        "load_duration": 0,
        "prompt_eval_count": t.prompt_tokens,
        "prompt_eval_duration": _ns(t.prefill_s),
        "eval_count": len(t.token_s),
        "eval_duration": _ns(t.decode_s),
    }


def _piece(text: str, shape: str) -> dict[str, Any]:
    if shape == "chat":
        return {"message": {"role": "assistant", "content": text}}
    return {"response": text}


async def _respond(
    s: ServerState,
    request: Request,
    ids: list[int],
    options: OllamaOptions,
    stream_it: bool,
    shape: str,
) -> Any:
    """Run a request and answer as Ollama does: NDJSON lines or one object."""
    limit = s.max_tokens_for(ids, None)
    if options.num_ctx is not None and options.num_ctx < s.llm.max_model_len:
        # The request's own context window, which output stops at (as Ollama's does with
        # shift: false; by default Ollama shifts its cache and goes on). A prompt longer than
        # it Ollama would cut down to fit; a cut prompt is not the prompt sent: refused.
        if len(ids) >= options.num_ctx:
            raise APIError(
                400,
                f"the prompt has {len(ids)} tokens: options.num_ctx {options.num_ctx} leaves "
                "no room for output (Ollama would drop the prompt's start; pdscope does not)",
                param="options.num_ctx",
            )
        limit = min(limit, options.num_ctx - len(ids))
    params = s.sampling(lambda: options.sampling(limit))
    stream = await s.start(request, ids, params, f"ollama-{uuid.uuid4().hex}")

    def piece(text: str) -> dict[str, Any]:
        return _piece(text, shape)

    if not stream_it:
        out = await collect(stream, request)
        return {
            "model": s.model_name,
            "created_at": _now(),
            **piece(out.text),
            **final_counters(out),
        }

    async def lines() -> AsyncIterator[str]:
        deltas = TextDeltas(params.stop)
        head = {"model": s.model_name}
        try:
            async for out in stream:
                if out.error:
                    yield ndjson({"error": out.error})
                    return
                text = deltas(out)
                if text:
                    yield ndjson({**head, "created_at": _now(), **piece(text), "done": False})
                if out.finished:
                    yield ndjson({**head, "created_at": _now(), **piece(""), **final_counters(out)})
        except EngineDeadError as exc:
            yield ndjson({"error": str(exc)})
        finally:
            await stream.aclose()

    return StreamingResponse(lines(), media_type="application/x-ndjson")


def _loaded(s: ServerState, shape: str) -> dict[str, Any]:
    """Ollama's answer to an empty prompt or message list, its way to load a model: a done
    object with no text (the model here is always loaded)."""
    return {
        "model": s.model_name,
        "created_at": _now(),
        **_piece("", shape),
        "done": True,
        "done_reason": "load",
    }


@router.post("/api/generate", response_model=None)
async def generate(body: OllamaGenerateRequest, request: Request) -> Any:
    s = state_of(request)
    s.check_model(body.model)
    if not body.prompt:
        return _loaded(s, "generate")
    if body.raw:
        ids = await s.encode(body.prompt, "prompt")
    else:
        messages = [ChatMessage(role="user", content=body.prompt)]
        if body.system:
            messages.insert(0, ChatMessage(role="system", content=body.system))
        ids = await s.chat_prompt(messages)
    return await _respond(s, request, ids, body.run_options, body.streams, "generate")


@router.post("/api/chat", response_model=None)
async def chat(body: OllamaChatRequest, request: Request) -> Any:
    s = state_of(request)
    s.check_model(body.model)
    if not body.messages:
        return _loaded(s, "chat")
    ids = await s.chat_prompt(body.messages)
    return await _respond(s, request, ids, body.run_options, body.streams, "chat")


def _details(s: ServerState) -> dict[str, Any]:
    config = s.llm.model.config
    params = s.llm.model.parameter_count()
    return {
        "parent_model": "",
        "format": "safetensors",
        "family": config.architecture.removesuffix("ForCausalLM").lower(),
        "families": [config.architecture.removesuffix("ForCausalLM").lower()],
        "parameter_size": f"{params / 1e6:.0f}M" if params < 1e9 else f"{params / 1e9:.1f}B",
        "quantization_level": str(s.llm.dtype).removeprefix("torch.").upper(),
    }


@router.get("/api/tags")
async def tags(request: Request) -> dict[str, Any]:
    s = state_of(request)
    size = sum(f.stat().st_size for f in s.llm.path.glob("*.safetensors"))
    return {
        "models": [
            {
                "name": s.model_name,
                "model": s.model_name,
                "modified_at": datetime.fromtimestamp(s.created, UTC).isoformat(),
                "size": size,
                "digest": uuid.uuid5(uuid.NAMESPACE_URL, str(s.llm.path)).hex,
                "details": _details(s),
            }
        ]
    }


@router.get("/api/ps")
async def ps(request: Request) -> dict[str, Any]:
    """The loaded models: always the one served, resident until the server stops."""
    s = state_of(request)
    size = sum(f.stat().st_size for f in s.llm.path.glob("*.safetensors"))
    on_gpu = str(s.llm.device).startswith("cuda")
    return {
        "models": [
            {
                "name": s.model_name,
                "model": s.model_name,
                "size": size,
                "digest": uuid.uuid5(uuid.NAMESPACE_URL, str(s.llm.path)).hex,
                "details": _details(s),
                # Never unloaded: Ollama's way of saying so is an expiry far in the future.
                "expires_at": "2318-01-01T00:00:00Z",
                "size_vram": size if on_gpu else 0,
                "context_length": s.llm.max_model_len,
            }
        ]
    }


@router.get("/api/version")
async def version() -> dict[str, str]:
    return {"version": __version__}


@router.post("/api/show")
async def show(body: OllamaShowRequest, request: Request) -> dict[str, Any]:
    s = state_of(request)
    s.check_model(body.model or body.name)
    config = s.llm.model.config
    family = config.architecture.removesuffix("ForCausalLM").lower()
    return {
        "modelfile": f"FROM {s.llm.path}",
        "parameters": "",
        "template": s.llm.tokenizer.chat_template or "",
        "details": _details(s),
        "model_info": {
            "general.architecture": family,
            "general.parameter_count": s.llm.model.parameter_count(),
            f"{family}.context_length": s.llm.max_model_len,
            f"{family}.embedding_length": config.hidden_size,
            f"{family}.block_count": config.num_layers,
            f"{family}.attention.head_count": config.num_heads,
            f"{family}.attention.head_count_kv": config.num_kv_heads,
        },
        "capabilities": ["completion"],
        "modified_at": datetime.fromtimestamp(s.created, UTC).isoformat(),
    }


def error_shape(status: int, message: str, kind: str, param: str | None) -> dict[str, Any]:
    return {"error": message}


ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {"type": "string"}},
}

DIALECT = Dialect(
    name="ollama",
    prefix="/api/",
    router=router,
    error_shape=error_shape,
    error_schema=ERROR_SCHEMA,
    stream_types={"/api/generate": "application/x-ndjson", "/api/chat": "application/x-ndjson"},
)
