"""A bounded schemathesis run over the served `/openapi.json` of live servers (the toy engine, and a tiny
real model with MTP speculation): generated requests, valid and not, to every route; no 5xx allowed, and
each server leaks nothing afterwards. The fuzzer (an independent tool) found the 500s of the hardening issue
from exactly this schema."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402 (after the skip: schemathesis brings it)
from hyspec_server import EngineArgs  # noqa: E402
from hyspec_server.builder import build_engine  # noqa: E402
from hyspec_testing.server import toy_engine  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402

EXAMPLES = 25  # per operation and server: a few hundred requests in all


@pytest.fixture(scope="module", params=["toy", "mtp"])
def live(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from hyspec_server.serve import ServerThread
    from hyspec_testing.tiny import build_tiny_checkpoint

    if request.param == "toy":
        engine = toy_engine(max_len=512)
    else:
        path = build_tiny_checkpoint(tmp_path_factory.mktemp("fuzz") / "q", "qwen3_5", seed=0, mtp_layers=1)
        spec = {"method": "mtp", "num_speculative_tokens": 2}
        engine = build_engine(
            EngineArgs(
                model=str(path), device="cpu", max_num_seqs=4, max_model_len=256, speculative_config=spec
            )
        )
    srv = ServerThread(engine, model_name="m").start()
    yield srv
    srv.wait_idle_and_leak_check()
    srv.stop()


def test_no_server_errors(live: Any) -> None:
    schema = schemathesis.openapi.from_url(live.base_url + "/openapi.json")
    ran = 0
    for result in schema.get_all_operations():
        operation = result.ok()

        @given(case=operation.as_strategy())
        @settings(
            max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True
        )
        def run(case: Any) -> None:
            case.call_and_validate(checks=[not_a_server_error], timeout=60)

        run()
        ran += 1
    assert ran >= 8  # every route of the schema was exercised


def test_schema_declares_the_bodies(live: Any) -> None:
    """The run above is only as wide as the schema: the generation routes declare their request bodies."""
    import httpx

    doc = httpx.get(live.base_url + "/openapi.json").json()
    for route in ("/v1/completions", "/v1/chat/completions"):
        assert "requestBody" in doc["paths"][route]["post"], route
