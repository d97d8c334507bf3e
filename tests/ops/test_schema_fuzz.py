"""Schema fuzzing: schemathesis over the OpenAPI schema the store serves, with an admin token.

Bounded in examples per operation and in total time (well under a minute):
generated requests must never cause a 500, every response must conform to
the served schema, and every error must carry the protocol's error body.
"""

from __future__ import annotations

import time

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.support.live_store import running_store, settings_for

EXAMPLES_PER_OPERATION = 40
#: The whole fuzz run's budget, asserted.
BUDGET_S = 60.0


@pytest.fixture(scope="module")
def fuzzed_store(tmp_path_factory):
    """A fresh embedded store: the fuzzer's writes touch nothing other tests look at."""
    home = tmp_path_factory.mktemp("fuzz")
    with running_store(settings_for("embedded", home, pg_url=None, s3=None), "embedded") as live:
        yield live


@pytest.fixture(scope="module")
def admin_token(fuzzed_store) -> str:
    return fuzzed_store.mint(
        "fuzz-admin", "*/*:read,write,owner:create,admin", "root/*:read,write,admin", platform=True
    )


def error_body_conformance(ctx, response, case) -> bool | None:
    """Every 4xx/5xx answers PROTOCOL.md's ``{"error": {"code", "message", "detail"}}``."""
    if response.status_code < 400 or case.method.upper() == "HEAD":
        return None
    body = response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"code", "message", "detail"}, body
    assert isinstance(body["error"]["code"], str) and body["error"]["code"].isupper(), body
    return True


CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    error_body_conformance,
]


def fuzz_operation(operation, token: str) -> None:
    """Up to ``EXAMPLES_PER_OPERATION`` generated calls of one operation, every check on each."""

    @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy())
    def run(case) -> None:
        case.call_and_validate(headers={"Authorization": f"Bearer {token}"}, checks=CHECKS, timeout=10)

    run()


def test_no_500_and_every_response_conforms(fuzzed_store, admin_token):
    # Loaded from the running store: the schema under test is the one it serves.
    schema = schemathesis.openapi.from_url(f"{fuzzed_store.base_url}/openapi.json")
    started = time.monotonic()
    failures, fuzzed = {}, []
    for result in schema.get_all_operations():
        operation = result.ok()
        fuzzed.append(operation.label)
        try:
            fuzz_operation(operation, admin_token)
        except (Exception, BaseExceptionGroup) as exc:  # collect every operation's first failure, then report them all
            failures[operation.label] = f"{type(exc).__name__}: {str(exc)[:1500]}"
    elapsed = time.monotonic() - started
    assert len(fuzzed) >= 10, fuzzed
    assert failures == {}
    assert elapsed < BUDGET_S
