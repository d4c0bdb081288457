"""The servers the HTTP tests share per session (started by tests/conftest.py's start_server).

The tiny model serves where the model does not matter (errors, auth, limits, the
WebSocket); SmolLM2 where the output is checked against a reference.
"""

from __future__ import annotations

import pytest

from tests.server_process import ServerProcess


@pytest.fixture(scope="session")
def tiny_server(start_server, tiny_artifacts) -> ServerProcess:
    return start_server("--artifacts", tiny_artifacts, "--served-model-name", "tiny", "tiny-alias")


@pytest.fixture(scope="session")
def smol_server(start_server, smollm2_artifacts) -> ServerProcess:
    return start_server("--artifacts", smollm2_artifacts, "--served-model-name", "smol")
