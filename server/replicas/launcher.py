"""`kiln serve --data-parallel N`: Ray started (or joined), the front and N engine replicas
deployed on Ray Serve, serving until SIGTERM/SIGINT, then drained and stopped.

The HTTP port is Ray Serve's proxy (one per node, so every node of a cluster answers);
each replica gets `replica_cpus` cores (its IREE task workers sized to them) or
`replica_gpus` GPUs. With autoscaling bounds, Ray adds replicas while each has more than
`target_ongoing_requests` in flight and removes idle ones down to the minimum.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import threading
from dataclasses import dataclass, field

from kiln.runtime.config import load_model_config
from kiln.runtime.service_config import ServiceConfig

from ..settings import ServerSettings
from .prefix_table import RoutingPolicy

log = logging.getLogger("kiln.replicas")
APP_NAME = "kiln"


@dataclass(frozen=True)
class DataParallelConfig:
    replicas: int = 2
    min_replicas: int | None = None  # with max_replicas: autoscale between the two
    max_replicas: int | None = None
    target_ongoing_requests: int = 16  # per replica, for autoscaling
    replica_cpus: float = 0.0  # 0: this machine's cores shared evenly
    replica_gpus: float = 0.0
    ray_address: str | None = None  # an existing cluster ("auto", "ray://host:10001"); None: start one here
    routing: RoutingPolicy = field(default_factory=RoutingPolicy)

    def __post_init__(self):
        if (self.min_replicas is None) != (self.max_replicas is None):
            raise ValueError("autoscaling needs both a minimum and a maximum replica count")
        if self.max_replicas is not None and not 0 < self.min_replicas <= self.replicas <= self.max_replicas:
            raise ValueError(f"replica counts must satisfy 0 < min ({self.min_replicas}) <= initial "
                             f"({self.replicas}) <= max ({self.max_replicas})")

    def cpus_per_replica(self) -> float:
        if self.replica_cpus:
            return self.replica_cpus
        return 0.0 if self.replica_gpus else max(1, (os.cpu_count() or 1) // self.replicas)

    def scaling(self) -> dict:
        if self.max_replicas is None:
            return {"num_replicas": self.replicas}
        return {"autoscaling_config": {"min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
                                       "initial_replicas": self.replicas,
                                       "target_ongoing_requests": self.target_ongoing_requests}}


def build_application(service_config: ServiceConfig, settings: ServerSettings, config: DataParallelConfig):
    """The Ray Serve application: the front bound to the engine deployment."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from .deployments import ENGINE_NAME, FRONT_NAME, KilnEngine, KilnFront
    from .router import PrefixAffinityRouter
    from .routing_key import RoutingKeysSpec

    artifacts = service_config.artifacts
    params, _ = load_model_config(artifacts.config)
    # The router's record of a replica's pages is bounded as the replica's cache is, host tier included.
    routing = dataclasses.replace(config.routing, pages_per_replica=replica_pages(service_config, params))
    cpus = config.cpus_per_replica()
    engine = serve.deployment(
        KilnEngine, name=ENGINE_NAME, **config.scaling(),
        ray_actor_options={"num_cpus": cpus, "num_gpus": config.replica_gpus},
        # The replica's own scheduler queues, prioritizes and refuses (503): Ray only routes.
        max_ongoing_requests=settings.max_connections,
        request_router_config=RequestRouterConfig(
            request_router_class=PrefixAffinityRouter,
            request_router_kwargs=dataclasses.asdict(routing),
            request_routing_stats_period_s=1.0),
        health_check_period_s=5.0,
        graceful_shutdown_timeout_s=settings.grace_seconds + 5,
        # A model that does not load will not load on a retry either: say so soon.
        max_constructor_retry_count=1,
    )
    front = serve.deployment(KilnFront, name=FRONT_NAME, num_replicas=1, ray_actor_options={"num_cpus": 0},
                             max_ongoing_requests=settings.max_connections)
    keys = RoutingKeysSpec(artifacts.tokenizer_path, params.block_seq_stride, settings.chat_template,
                           settings.max_prompt_chars)
    threads = 0 if config.replica_gpus else max(1, int(cpus))
    grpc_address = None if settings.grpc_port is None else f"{settings.host}:{settings.grpc_port}"
    # Each replica's gRPC server listens where only the replica itself calls it.
    replica_settings = settings if grpc_address is None else dataclasses.replace(
        settings, host="127.0.0.1", grpc_port=0)
    return front.bind(engine.bind(service_config, replica_settings, threads), keys, grpc_address,
                      settings.max_body_bytes)


def replica_pages(service_config: ServiceConfig, params) -> int:
    """How many pages one replica's prefix cache can hold: its device pages and its host tier's."""
    pages = service_config.page_count or params.paged_kv_cache.device_block_count
    if service_config.host_kv_bytes:
        pages += service_config.host_kv_bytes // params.page_bytes
    return pages


def serve_data_parallel(service_config: ServiceConfig, settings: ServerSettings, config: DataParallelConfig,
                        log_level: str = "info") -> int:
    """Serve until a signal; returns the process exit code."""
    import ray
    from ray import serve

    from .deployments import FRONT_NAME

    if settings.kv_events_endpoint:
        raise SystemExit("kiln serve: --kv-events-endpoint is per server: with --data-parallel the front "
                         "routes by prefix itself")
    for port in (settings.port, settings.grpc_port):
        if port is not None and not _free(settings.host, port):
            raise SystemExit(f"kiln serve: {settings.host}:{port} is already in use")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # Ray would report usage over the network
    try:
        ray.init(address=config.ray_address, include_dashboard=False, logging_level=log_level.upper(),
                 log_to_driver=True)
    except (ConnectionError, RuntimeError, ValueError) as error:
        raise SystemExit(f"kiln serve: cannot start or join Ray ({config.ray_address or 'here'}): {error}") from None
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # after ray.init, which installs handlers of its own
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": settings.host, "port": settings.port})
        serve.run(build_application(service_config, settings, config), name=APP_NAME, route_prefix="/")
        log.info("ready: %s behind one front on http://%s:%d", _replicas_text(config), settings.host, settings.port)
        while not stop.wait(1.0):
            pass
        log.info("draining: new requests get 503, running ones up to %.0fs to finish", settings.grace_seconds)
        front = serve.get_deployment_handle(FRONT_NAME, APP_NAME)
        unfinished = front.drain.remote(settings.grace_seconds).result(timeout_s=settings.grace_seconds + 30)
        if unfinished:
            log.warning("%d request(s) still running after the grace period: stopping them", unfinished)
        serve.shutdown()
        return 0
    except RuntimeError as error:  # a replica could not start (the model did not load): Ray said why
        log.error("the replicas did not start: %s", error)
        return 1
    finally:
        ray.shutdown()


def _free(host: str, port: int) -> bool:
    """Whether nothing listens on host:port now (Ray's proxy would fail on it later, less clearly)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: TIME_WAIT is no obstacle
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def _replicas_text(config: DataParallelConfig) -> str:
    if config.max_replicas is not None:
        return f"{config.min_replicas}-{config.max_replicas} engine replicas (autoscaled)"
    return f"{config.replicas} engine replicas"
