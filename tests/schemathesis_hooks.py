"""Schemathesis hooks for tests/test_schemathesis.py (loaded through SCHEMATHESIS_HOOKS).

Two rules no JSON schema can state: prompt tokens plus output tokens must fit the context, and
min_tokens may not exceed max_tokens. A schema-valid request breaking one gets OpenAI's and
vLLM's 400 ("maximum context length", "min_tokens ... is more than max_tokens"); this check is
schemathesis' own positive-data check with those two answers allowed, and nothing else.
"""

from __future__ import annotations

from typing import Any

import schemathesis
from schemathesis.specs.openapi.checks import positive_data_acceptance


@schemathesis.check
def positive_data_acceptance_within_context(ctx: Any, response: Any, case: Any) -> bool | None:
    if response.status_code == 400 and (
        "maximum context length" in response.text or "is more than max_tokens" in response.text
    ):
        return None
    return positive_data_acceptance(ctx, response, case)
