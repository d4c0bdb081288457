"""What the HTTP layer is configured with: everything `kiln serve` takes that is not the model.

One dataclass, filled by the CLI (or a test), read by the app and its middleware.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    # Names the /v1 routes answer to; the first is the one /v1/models lists first.
    served_model_names: tuple[str, ...] = ("kiln",)
    chat_template: str | None = None  # overrides tokenizer_config.json's
    api_keys: tuple[str, ...] = ()  # empty: no authentication
    cors_origins: tuple[str, ...] = ()
    rate_limit: float = 0.0  # requests per second per API key (or client address); 0: off
    max_body_bytes: int = 16 * 2**20
    max_n: int = 64  # completions per prompt
    max_prompts: int = 256  # prompts per /v1/completions or /generate request
    grace_seconds: float = 30.0  # on SIGTERM: how long in-flight requests may take to finish
    log_requests: bool = True

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def knows_model(self, name: str | None) -> bool:
        return name is None or name == "" or name in self.served_model_names
