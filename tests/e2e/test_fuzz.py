"""Schemathesis against nograd's own OpenAPI schema: no generated input may cause a 5xx, and
every response must match what the schema documents."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import checks

from tests.e2e.serving import Server

pytestmark = pytest.mark.e2e
# Bounded so `make test` stays fast; the slow marker runs a deeper pass.
EXAMPLES = 15


def fuzz(server: Server, examples: int) -> int:
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    operations = 0
    for result in schema.get_all_operations():
        operation = result.ok()
        operations += 1

        @given(case=operation.as_strategy())
        @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck))
        def check(case: schemathesis.Case) -> None:
            # A schema-valid body can still be semantically wrong (data length vs shape, an
            # input name the model lacks): that is a documented 400, not a schema lie.
            case.call_and_validate(excluded_checks=[checks.positive_data_acceptance])

        check()
    return operations


def test_generated_requests_never_get_a_server_error(server: Server) -> None:
    assert fuzz(server, EXAMPLES) >= 10


@pytest.mark.slow
def test_deep_fuzz(server: Server) -> None:
    fuzz(server, 300)
