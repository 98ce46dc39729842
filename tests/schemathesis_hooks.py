"""Schemathesis hooks for tests/test_schemathesis.py (loaded through SCHEMATHESIS_HOOKS).

One rule no JSON schema can state: prompt tokens plus output tokens must fit the context. A
schema-valid request over it gets OpenAI's and vLLM's 400 "maximum context length"; this check
is schemathesis' own positive-data check with that one answer allowed, and nothing else.
"""

from __future__ import annotations

from typing import Any

import schemathesis
from schemathesis.specs.openapi.checks import positive_data_acceptance


@schemathesis.check
def positive_data_acceptance_within_context(ctx: Any, response: Any, case: Any) -> bool | None:
    if response.status_code == 400 and "maximum context length" in response.text:
        return None
    return positive_data_acceptance(ctx, response, case)
