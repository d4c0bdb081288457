"""What the HTTP layer is configured with: everything `kiln serve` takes that is not the model.

One dataclass, filled by the CLI (or a test), read by the app and its middleware.
"""

from __future__ import annotations

from dataclasses import dataclass

from .reasoning import reasoning_parser


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    grpc_port: int | None = None  # KServe v2 and VllmEngine over gRPC, on the same host; None: off
    # Where the prefix cache's KV events go over ZMQ, in vLLM's format (with ServiceConfig.kv_events).
    kv_events_endpoint: str | None = None
    kv_events_topic: str = ""
    # Names the /v1 routes answer to; the first is the one /v1/models lists first.
    served_model_names: tuple[str, ...] = ("kiln",)
    # Other names requests may give, not listed (the path a model was given by, under which vLLM
    # would serve it).
    model_aliases: tuple[str, ...] = ()
    chat_template: str | None = None  # overrides tokenizer_config.json's
    tool_call_parser: str = "auto"  # how tool calls are written: server/tool_calls.py's PARSERS
    # How a reasoning model's thinking is split from its answer on chat (server/reasoning.py's
    # PARSERS); None: not split, the reply is all content.
    reasoning_parser: str | None = None
    api_keys: tuple[str, ...] = ()  # empty: no authentication
    cors_origins: tuple[str, ...] = ()
    rate_limit: float = 0.0  # requests per second per API key (or client address); 0: off
    max_body_bytes: int = 16 * 2**20  # also the largest WebSocket message
    # The longest prompt text (or rendered chat) tokenized; longer is a 400 before any work.
    max_prompt_chars: int = 2**20
    max_n: int = 64  # completions per prompt
    max_prompts: int = 256  # prompts per /v1/completions or /generate request
    grace_seconds: float = 30.0  # on SIGTERM: how long in-flight requests may take to finish
    header_timeout: float = 10.0  # seconds a client has to send a request's headers
    keep_alive_timeout: float = 5.0  # seconds an idle keep-alive connection stays open
    max_connections: int = 1024  # connections (and WebSockets) at once; beyond it, 503
    log_requests: bool = True

    def __post_init__(self):
        reasoning_parser(self.reasoning_parser)  # an unknown name fails here, naming the choices

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def knows_model(self, name: str | None) -> bool:
        return name is None or name == "" or name in self.served_model_names or name in self.model_aliases
