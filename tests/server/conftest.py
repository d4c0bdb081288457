"""The servers the HTTP tests share per session (started by tests/conftest.py's start_server).

The tiny model serves where the model does not matter (errors, auth, limits, the
WebSocket); SmolLM2 where the output is checked against a reference.
"""

from __future__ import annotations

import threading
import time

import pytest
import uvicorn

from kiln.runtime import GenerateService, ServiceConfig
from kiln.runtime.contract import Artifacts
from kiln.server.app import create_app
from kiln.server.main import uvicorn_config
from kiln.server.settings import ServerSettings
from tests.fake_program import FakeProgram
from tests.server_process import ServerProcess, free_port


@pytest.fixture(scope="session")
def tiny_server(start_server, tiny_artifacts) -> ServerProcess:
    return start_server("--artifacts", tiny_artifacts, "--served-model-name", "tiny", "tiny-alias")


@pytest.fixture(scope="session")
def smol_server(start_server, smollm2_artifacts) -> ServerProcess:
    return start_server("--artifacts", smollm2_artifacts, "--served-model-name", "smol")


@pytest.fixture(scope="session")
def start_fake_server(fake_model_dir):
    """start_fake_server(**settings) -> (port, service): a real server on 127.0.0.1 (uvicorn,
    configured as `kiln serve` configures it) over the fake program, in a thread, stopped at
    the end of the session. It also answers GET /fail with an error of Kiln's own. `model_dir`
    and `program_factory` put other artifacts or another program (a scripted one) in its place."""
    running = []

    def start(model_dir=None, program_factory=FakeProgram, **overrides):
        artifacts = Artifacts.in_directory(model_dir or fake_model_dir)
        service = GenerateService(ServiceConfig(artifacts), program_factory=program_factory)
        settings = ServerSettings(**{"port": free_port(), "served_model_names": ("fake",), "log_requests": False,
                                     **overrides})
        app = create_app(service, settings)

        @app.get("/fail", include_in_schema=False)
        async def fail():
            raise RuntimeError("a bug in Kiln, not the client's fault")

        server = uvicorn.Server(uvicorn_config(app, settings, log_level="error"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        running.append((server, thread))
        deadline = time.monotonic() + 30
        while not (server.started and service.state.value == "ready") and time.monotonic() < deadline:
            time.sleep(0.02)
        return settings.port, service

    yield start
    for server, thread in running:
        server.should_exit = True
        thread.join(30)


@pytest.fixture(scope="session")
def fake_server(start_fake_server) -> int:
    """The fake-program server with small limits, so that tests can reach them: its port."""
    port, _ = start_fake_server(max_body_bytes=4096, header_timeout=1.0, max_connections=24, max_n=4, max_prompts=8)
    return port
