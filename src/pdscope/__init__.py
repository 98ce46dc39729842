"""pdscope: see the two phases of LLM serving, prefill and decode.

``from pdscope import LLM, SamplingParams`` gives the offline engine API; the import is lazy so
that commands which need no engine (``pdscope plan``) never load torch.
"""

from typing import Any

__version__ = "0.1.0"
__all__ = ["LLM", "EngineArgs", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    if name in ("LLM", "EngineArgs"):
        from pdscope.engine import llm_engine

        return getattr(llm_engine, name)
    if name == "SamplingParams":
        from pdscope.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'pdscope' has no attribute {name!r}")
