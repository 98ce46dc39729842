"""Recognise what is serving at a URL: which API it speaks, which runtime it is, which models."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import httpx

from pdscope.client.adapters import API_OLLAMA, API_OPENAI_COMPLETIONS, OPENAI_APIS
from pdscope.client.server_metrics import METRIC_PREFIXES


class ProbeError(RuntimeError):
    """The target cannot be probed (unreachable, no known API, unknown model)."""


@dataclass
class Runtime:
    url: str
    name: str  # vllm, sglang, tgi, llama.cpp, ollama, pdscope, openai-compatible
    api: str  # the API to use: openai-completions or ollama
    models: list[str]
    has_tokenize: bool = False
    has_metrics: bool = False
    max_model_len: int | None = None
    evidence: list[str] = field(default_factory=list)  # what the detection saw
    version: str | None = None  # the runtime's own version, where it says (/version)
    tokenize_key: str = "prompt"  # /tokenize's text field; llama.cpp's is "content"

    def pick_model(self, asked: str | None) -> str:
        if asked:
            if self.models and asked not in self.models and f"{asked}:latest" not in self.models:
                raise ProbeError(
                    f"{self.url} does not serve model {asked!r}; it serves: "
                    f"{', '.join(self.models)}"
                )
            return asked
        if len(self.models) == 1:
            return self.models[0]
        if not self.models:
            raise ProbeError(f"{self.url} lists no models; pass --model")
        raise ProbeError(
            f"{self.url} serves {len(self.models)} models "
            f"({', '.join(self.models[:6])}); choose one with --model"
        )


async def detect(
    client: httpx.AsyncClient, url: str, api: str = "auto", headers: dict[str, str] | None = None
) -> Runtime:
    base = url.rstrip("/")

    async def get(path: str) -> httpx.Response | None:
        with contextlib.suppress(httpx.HTTPError):
            return await client.get(base + path, headers=headers, timeout=10)
        return None

    try:
        await client.get(base + "/", headers=headers, timeout=10)
    except httpx.ConnectError as exc:
        raise ProbeError(f"cannot connect to {base}: {exc}") from exc
    except httpx.TimeoutException as exc:
        raise ProbeError(f"{base} did not answer within 10 s") from exc
    except httpx.HTTPError as exc:
        raise ProbeError(f"cannot reach {base}: {exc}") from exc

    evidence: list[str] = []
    models_resp = await get("/v1/models")
    openai_models: list[str] = []
    openai_listed = False  # /v1/models answered with a list, even an empty one
    owner = ""
    max_len = None
    if models_resp is not None and models_resp.status_code == 401:
        if headers and "Authorization" in headers:
            raise ProbeError(f"{base} refused the API key given (401 on /v1/models)")
        raise ProbeError(f"{base} requires an API key (401 on /v1/models): pass --api-key")
    if models_resp is not None and models_resp.status_code == 200:
        with contextlib.suppress(ValueError, KeyError, TypeError):
            data = models_resp.json()["data"]
            openai_models = [m["id"] for m in data]
            openai_listed = isinstance(data, list)
            owner = str(data[0].get("owned_by", "")) if data else ""
            max_len = data[0].get("max_model_len") if data else None
        evidence.append(f"/v1/models lists {len(openai_models)} model(s)")

    tags = await get("/api/tags")
    ollama_models: list[str] = []
    if tags is not None and tags.status_code == 200:
        with contextlib.suppress(ValueError, KeyError, TypeError):
            ollama_models = [m.get("model") or m["name"] for m in tags.json()["models"]]
        evidence.append(f"/api/tags lists {len(ollama_models)} model(s)")

    metrics = await get("/metrics")
    metric_runtime = None
    has_metrics = metrics is not None and metrics.status_code == 200
    if has_metrics:
        text = metrics.text
        metric_runtime = next((name for prefix, name in METRIC_PREFIXES if prefix in text), None)
        evidence.append(f"/metrics ({metric_runtime or 'unknown names'})")
    has_tokenize = False
    tokenize_key = "prompt"
    if openai_listed:  # an empty list too: --model names what the server does not list
        # vLLM/SGLang/pdscope read "prompt" and return {"tokens": [...]}. llama.cpp reads
        # "content" and answers 200 with no tokens to a "prompt": a tokenizer that tokenizes
        # nothing is no tokenizer, so each field is tried and the one that yields tokens kept.
        for key in ("prompt", "content"):
            with contextlib.suppress(httpx.HTTPError, ValueError, AttributeError, TypeError):
                answer = await client.post(
                    base + "/tokenize", json={key: "probe"}, headers=headers, timeout=10
                )
                tokens = answer.json().get("tokens") if answer.status_code == 200 else None
                if tokens and all(isinstance(t, int) for t in tokens):
                    has_tokenize, tokenize_key = True, key
                    break
    if has_tokenize:
        evidence.append(f"/tokenize works ({tokenize_key!r} field)")
    props = await get("/props")
    is_llamacpp = props is not None and props.status_code == 200 and "n_ctx" in props.text
    if is_llamacpp:
        evidence.append("/props (llama.cpp)")
        with contextlib.suppress(ValueError, AttributeError, TypeError):
            settings = props.json().get("default_generation_settings") or {}
            max_len = max_len or settings.get("n_ctx") or props.json().get("n_ctx")

    version = None
    for path in ("/version", "/api/version"):  # vLLM and SGLang; Ollama (and pdscope)
        answer = await get(path)
        if answer is not None and answer.status_code == 200:
            with contextlib.suppress(ValueError, AttributeError):
                version = str(answer.json().get("version")) or None
            if version:
                break

    ollama_native = tags is not None and tags.status_code == 200 and owner != "pdscope"
    if ollama_native and api == "auto":
        api = API_OLLAMA  # Ollama also serves /v1; its native API carries its own timings
    if owner == "pdscope":
        name = "pdscope"
    elif is_llamacpp:
        name = "llama.cpp"
    else:
        name = metric_runtime or ("vllm" if owner == "vllm" else "openai-compatible")
    if openai_listed and api in ("auto", *OPENAI_APIS):
        chosen = API_OPENAI_COMPLETIONS if api == "auto" else api
        return Runtime(
            base,
            name,
            chosen,
            openai_models,
            has_tokenize,
            has_metrics,
            max_len,
            evidence,
            version,
            tokenize_key,
        )
    if ollama_models or (tags is not None and tags.status_code == 200):
        if api not in ("auto", API_OLLAMA):
            raise ProbeError(f"{base} speaks Ollama's API, not {api}")
        if ollama_native:
            return Runtime(
                base, "ollama", API_OLLAMA, ollama_models, False, has_metrics, None, evidence,
                version,
            )  # fmt: skip
        # another runtime that speaks Ollama's API too (pdscope serve, told --api ollama): it
        # is still itself, with its own context (prompts stay text: Ollama's API takes no ids)
        return Runtime(
            base, name, API_OLLAMA, ollama_models or openai_models, False, has_metrics, max_len,
            evidence, version,
        )  # fmt: skip
    if api == API_OLLAMA:
        raise ProbeError(f"{base} does not answer Ollama's /api/tags")
    raise ProbeError(f"no OpenAI-compatible (/v1/models) or Ollama (/api/tags) API at {base}")
