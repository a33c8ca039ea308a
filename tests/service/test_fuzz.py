"""Schema-driven fuzzing of every operation in the OpenAPI spec (schemathesis, in process).

The real app on SQLite and on PostgreSQL with the real in-process executor and example
checkpoints under an allowed root: whatever the generated request, the answer is never a 5xx,
and every error is JSON of the one shape `{"error": {"code", "message", "details"}}`.

Positive and negative cases for every operation, derandomized so a failure reproduces. (The
schemathesis pytest plugin's lazy `from_fixture` does not work with this pytest, so the
Hypothesis tests are built per operation here.)
"""

from __future__ import annotations

import shutil
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.checks import not_a_server_error
from schemathesis.core.result import Ok
from schemathesis.generation.modes import GenerationMode
from schemathesis.python.asgi import shutdown_lifespans
from schemathesis.specs.openapi.schemas import OpenApiSchema

from core.db.migrate import upgrade
from layerswap.app import build_app
from tests.helpers import wait_for
from tests.service.conftest import make_settings

MAX_EXAMPLES = 20


@pytest.fixture
def api_schema(tmp_path: Path, database_url: str, examples: Path) -> Iterator[OpenApiSchema]:
    service_settings = make_settings(tmp_path, database_url)
    for name in ("base", "math", "swh"):
        shutil.copytree(examples / name, service_settings.source_roots[0] / name)
        # where the spec's documented example request looks for them
        shutil.copytree(examples / name, service_settings.source_roots[0] / "examples" / name)
    upgrade(database_url)
    app = build_app(service_settings)
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)  # starts the app's lifespan
    try:
        yield schema
        # Let the executor finish the jobs the fuzzing queued before the store goes away.
        executor = app.state.context.executor
        wait_for(executor.idle, "the fuzzed jobs to finish", 120, interval=0.05)
    finally:
        shutdown_lifespans()  # stops the executor and disposes of the engine


def error_is_json_shape(ctx: Any, response: Any, case: Any) -> bool | None:
    """Every 4xx/5xx is `{"error": {"code": str, "message": str, "details": dict}}`."""
    if response.status_code < 400:
        return None
    content_type = response.headers.get("content-type", [""])
    content_type = content_type[0] if isinstance(content_type, list) else content_type
    assert content_type.startswith("application/json"), (
        f"{response.status_code} answered as {content_type!r}, not JSON"
    )
    body = response.json()
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert isinstance(error, dict) and set(error) == {"code", "message", "details"}, error
    assert isinstance(error["code"], str) and error["code"], error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["details"], dict), error
    assert "Traceback" not in response.text
    return True


def test_no_server_errors_and_one_error_shape(api_schema: OpenApiSchema) -> None:
    operations = []
    for result in api_schema.get_all_operations():
        assert isinstance(result, Ok), result.err()  # an operation the spec describes badly
        operations.append(result.ok())
    labels = {operation.label for operation in operations}
    assert {"POST /v1/merges", "GET /v1/merges", "POST /v1/analyses"} <= labels, labels

    statuses: Counter[int] = Counter()

    def error_shape(ctx: Any, response: Any, case: Any) -> bool | None:
        statuses[response.status_code] += 1
        return error_is_json_shape(ctx, response, case)

    failures: list[str] = []
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(
                max_examples=MAX_EXAMPLES,
                deadline=None,
                suppress_health_check=list(HealthCheck),
                derandomize=True,
                database=None,
            )
            def fuzz(case: Any) -> None:
                case.call_and_validate(checks=[not_a_server_error, error_shape])

            try:
                fuzz()
            except Unsatisfiable:
                assert mode is GenerationMode.NEGATIVE, operation.label  # nothing to break
            except (Exception, BaseExceptionGroup) as e:  # schemathesis raises groups
                failures.append(f"{operation.label} ({mode.value}): {e}")
    # Random paths name no checkpoint (422 source_not_found), so a 202 is reached through the
    # spec's own documented example request, checked like every fuzzed case.
    submit = next(o for o in operations if o.label == "POST /v1/merges")
    content = api_schema.raw_schema["paths"]["/v1/merges"]["post"]["requestBody"]["content"]
    for example in content["application/json"]["examples"].values():
        case = submit.Case(body=example["value"], media_type="application/json")
        case.call_and_validate(checks=[not_a_server_error, error_shape])
    assert not failures, "\n\n".join(failures)
    # The run reached the handlers, valid and invalid requests alike.
    assert statuses[200] and statuses[202] and statuses[404] and statuses[422], statuses
