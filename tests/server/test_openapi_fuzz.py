"""Property-based requests over the OpenAPI document, against a real server: never a 5xx.

A fixed seed (derandomized) and a fixed budget of examples per operation keep it to well
under a couple of minutes; the server is the fake-program one, so responses are fast.
"""

from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, given, settings

EXAMPLES_PER_OPERATION = 40


def test_no_request_gets_a_server_error(fake_server):
    schema = schemathesis.openapi.from_url(f"http://127.0.0.1:{fake_server}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/v1/messages", "/generate",
                                                "/v1/embeddings", "/v1/score", "/v1/rerank"}
    failures = []
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=EXAMPLES_PER_OPERATION, derandomize=True, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        def call(case):
            response = case.call(timeout=60)
            if response.status_code >= 500:
                failures.append((case.method, case.path, case.body, response.status_code, response.text[:300]))

        call()
    assert not failures, failures[:5]
