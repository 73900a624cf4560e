"""Schema-driven fuzzing of the HTTP API with schemathesis: every operation in the app's OpenAPI
document gets generated requests (valid and invalid field values, random bytes as audio); none may
get a 5xx, every status, content type and body must be the ones the document declares, and every
error must come in OpenAI's shape. (Schema-valid requests may still get a 400: random bytes are
rarely audio, which a schema cannot say.) Bounded: a fixed number of examples per
operation, derandomized (the same requests every run), no example database."""
from __future__ import annotations

import pytest
from conftest import require_real

if not require_real():  # CI installs the server extra, so a missing package fails there
    pytest.importorskip("fastapi")
    pytest.importorskip("schemathesis")
import schemathesis  # noqa: E402
from schemathesis import checks  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402

from specwhisper import Engine  # noqa: E402
from specwhisper.serving.server import create_app  # noqa: E402

EXAMPLES_PER_OPERATION = 25
CHECKS = [checks.not_a_server_error, checks.status_code_conformance, checks.content_type_conformance,
          checks.response_schema_conformance]


def test_no_operation_answers_5xx(multilingual):
    app = create_app(Engine(multilingual), max_new_tokens=2, max_upload_mb=1, max_queue=8)
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/audio/transcriptions", "/v1/audio/translations",
                                              "/transcribe", "/v1/models", "/health", "/metrics"}
    seen = []
    for operation in operations:
        @given(case=operation.as_strategy())
        @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def fuzz(case):
            response = case.call_and_validate(checks=CHECKS)
            seen.append((operation.path, response.status_code))
            assert response.status_code < 500, (case.as_curl_command(), response.text[:500])
            if response.status_code >= 400:
                error = response.json()["error"]
                assert set(error) == {"message", "type", "param", "code"}, response.text

        fuzz()
    assert len(seen) >= len(operations)  # every operation was exercised
