"""Property-based fuzzing of the server's own OpenAPI schema (schemathesis): whatever a client
sends, valid or not, the answer is never a 5xx and always comes back in time."""

from __future__ import annotations

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from tests.server.harness import running_app, tiny_engine

MAX_EXAMPLES = 100  # per generation mode, over all operations
CALL_TIMEOUT_S = 30


@pytest.fixture(scope="module")
def server():
    # A short context keeps every generated request quick (max_tokens defaults to the rest).
    engine = tiny_engine(max_model_len=48)
    with running_app(engine, max_request_bytes=256 * 1024) as url:
        yield url, engine
    engine.shutdown()


@pytest.fixture(scope="module")
def session():
    session = requests.Session()
    session.trust_env = False  # loopback only, whatever proxy the environment names
    yield session
    session.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_input_gets_a_5xx_or_hangs(server, session, mode):
    """Slow (about 10 s): schemathesis sends a few hundred generated bodies to every route."""
    url, engine = server
    api = schemathesis.openapi.from_url(url + "/openapi.json")
    operations = [result.ok() for result in api.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions"}
    strategy = st.one_of([op.as_strategy(generation_mode=mode) for op in operations])

    @given(case=strategy)
    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def check(case):
        response = case.call(base_url=url, session=session, timeout=CALL_TIMEOUT_S)
        assert response.status_code < 500, (case.path, case.body, response.text[:500])
        if response.status_code >= 400 and case.path.startswith("/v1/"):
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}
        assert engine.healthy

    check()
