"""`python -m tests.fake_server DIRECTORY PORT [--hold-route]`: a `kiln serve` over the fake program
in a process of its own, for tests whose measurements the test process's own threads would disturb
(the in-process servers of tests/server/conftest.py share its interpreter lock with every other
server and client of the session).

`--hold-route` adds GET /hold, which holds the event loop for ten minutes without yielding.
"""

from __future__ import annotations

import argparse
import time

from kiln.runtime import GenerateService, ServiceConfig
from kiln.runtime.contract import Artifacts
from kiln.server.app import create_app, drain
from kiln.server.main import KilnServer, uvicorn_config
from kiln.server.settings import ServerSettings
from tests.fake_program import FakeProgram


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("directory")
    parser.add_argument("port", type=int)
    parser.add_argument("--hold-route", action="store_true")
    args = parser.parse_args()
    service = GenerateService(ServiceConfig(Artifacts.in_directory(args.directory)), program_factory=FakeProgram)
    settings = ServerSettings(port=args.port, served_model_names=("fake",), grace_seconds=1.0, log_requests=False)
    app = create_app(service, settings)
    if args.hold_route:
        @app.get("/hold")
        async def hold():
            time.sleep(600)  # never yields to the loop

    server = KilnServer(uvicorn_config(app, settings, log_level="warning"), drain=lambda: drain(app),
                        grace_seconds=settings.grace_seconds)
    server.run()


if __name__ == "__main__":
    main()
