"""`kiln serve`: the HTTP server (shortfin's /generate, OpenAI's API, /ws, /health, /metrics).

With no model arguments it serves the bundled SmolLM2, built on first use into Kiln's
keyed cache. Building (export needs torch) runs in a child process, so the serving
process itself never imports torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path

from kiln.runtime.pooling import POOLING_MODES
from kiln.runtime.service_config import (
    DEFAULT_MEMORY_FRACTION,
    HOST_WRITE_POLICIES,
    PREFIX_SHARING,
    SAMPLING_DEFAULTS,
    ServiceConfig,
    SpeculativeConfig,
)
from kiln.server.reasoning import PARSERS as REASONING_PARSERS
from kiln.server.replicas.prefix_table import POLICIES, RoutingPolicy
from kiln.server.settings import ServerSettings
from kiln.server.tool_calls import PARSERS

from .model_args import add_model_arguments, device_name, resolve_artifacts


def _positive_float(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


_BYTE_UNITS = {"": 1, "b": 1, **{f"{p}{b}": 1000**n for n, p in enumerate("kmgt", 1) for b in ("", "b")},
               **{f"{p}ib": 1024**n for n, p in enumerate("kmgt", 1)}}


def _byte_size(text: str) -> int:
    """A size in bytes: 1000000, 512MiB, 4G, 2.5GiB."""
    number = text.rstrip("bBkKmMgGtTiI")
    unit = text[len(number):].lower()
    try:
        value = float(number) * _BYTE_UNITS[unit]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"expected a size such as 4GiB or 500M, got {text}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return int(value)


def _memory_fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction such as 0.9, got {text}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def _cache_memory(text: str) -> int | float:
    """A size in bytes (4GiB), or a fraction of the device's memory (0.9)."""
    if text.rstrip("bBkKmMgGtTiI") != text:
        return _byte_size(text)
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size such as 4GiB or a fraction such as 0.9, got {text}") from None
    if 0 < value <= 1:
        return value
    if value > 1 and value == int(value):  # a plain number of bytes
        return int(value)
    raise argparse.ArgumentTypeError(f"expected a size such as 4GiB or a fraction in (0, 1], got {text}")


def _lora_adapter(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH (a PEFT adapter directory), got {text!r}")
    return name, path


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def add_command(commands) -> None:
    parser = commands.add_parser("serve", help="serve a compiled model over HTTP (OpenAI API, /generate)")
    add_model_arguments(parser)
    settings = ServerSettings()
    server = parser.add_argument_group("server")
    server.add_argument("--host", default=settings.host, help="address to listen on (default: %(default)s; "
                        "0.0.0.0: every interface)")
    server.add_argument("--port", type=int, default=settings.port, help="HTTP port (default: %(default)s)")
    server.add_argument("--served-model-name", nargs="+", metavar="NAME",
                        help="name(s) the API answers to (default: the model's)")
    server.add_argument("--chat-template", metavar="F", help="a Jinja chat template file (or the template itself)")
    server.add_argument("--tool-call-parser", choices=PARSERS, default=settings.tool_call_parser,
                        help="how the model writes tool calls: hermes (<tool_call> JSON), llama3_json, or "
                        "auto (from the chat template; default)")
    server.add_argument("--reasoning-parser", choices=list(REASONING_PARSERS), default=settings.reasoning_parser,
                        help="split a reasoning model's thinking (<think>...</think>) from its answer on chat: "
                        "message.reasoning_content / delta.reasoning_content, and a reasoning item on /v1/responses; "
                        "tool calls and structured output apply to the answer (default: off)")
    server.add_argument("--api-key", action="append", default=[], metavar="KEY",
                        help="require 'Authorization: Bearer KEY' (repeatable; also $KILN_API_KEY)")
    server.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                        help="allow browsers from this origin (repeatable; '*' for any)")
    server.add_argument("--rate-limit", type=_positive_float, default=0.0, metavar="R",
                        help="requests per second per API key (or client address), bursts of R; 0: off")
    server.add_argument("--grpc-port", type=_positive_int, metavar="N",
                        help="also serve gRPC on this port: KServe v2 (tritonclient) and vLLM's VllmEngine "
                        "(the smg gateway), same host and API keys (needs the grpc extra)")
    server.add_argument("--max-body-bytes", type=_positive_int, default=settings.max_body_bytes, metavar="N",
                        help="the largest request body (default: %(default)s)")
    server.add_argument("--max-prompt-chars", type=_positive_int, default=settings.max_prompt_chars, metavar="N",
                        help="the longest prompt (or rendered chat) tokenized; longer is refused (default: %(default)s)")
    server.add_argument("--header-timeout", type=_positive_float, default=settings.header_timeout, metavar="S",
                        help="seconds a client has to send a request's headers (default: %(default)s)")
    server.add_argument("--keep-alive-timeout", type=_positive_float, default=settings.keep_alive_timeout,
                        metavar="S", help="seconds an idle connection stays open (default: %(default)s)")
    server.add_argument("--max-connections", type=_positive_int, default=settings.max_connections, metavar="N",
                        help="open connections at once; beyond them new requests get 503 (default: %(default)s)")
    server.add_argument("--grace-period", type=_positive_float, default=settings.grace_seconds, metavar="S",
                        help="on SIGTERM/SIGINT, seconds in-flight requests get to finish (default: %(default)s)")
    server.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                        help="default: %(default)s")
    server.add_argument("--no-access-log", action="store_true", help="no log line per request")
    engine = parser.add_argument_group("engine")
    defaults = ServiceConfig()
    engine.add_argument("--prefix-sharing", choices=PREFIX_SHARING, default=defaults.prefix_sharing,
                        help="trie: requests that start alike share their cached KV pages (default); none: off")
    engine.add_argument("--sampling-defaults", choices=SAMPLING_DEFAULTS, default=defaults.sampling_defaults,
                        help="what a request's unset temperature, top_p, top_k, min_p and repetition_penalty "
                        "are: model: the model's own (its generation_config.json, a GGUF's general.sampling "
                        "keys; the bundled model's card: temperature 0.2, top_p 0.9), else OpenAI's; openai: "
                        "OpenAI's always (temperature 1, top_p 1) (default: %(default)s)")
    engine.add_argument("--lora", "--lora-modules", nargs="+", type=_lora_adapter, default=[], metavar="NAME=PATH",
                        help="LoRA adapters (PEFT directories) to load at start, each served as the model NAME "
                        "(builds the model with adapter slots, as --enable-lora)")
    engine.add_argument("--pooling", choices=POOLING_MODES, default=None,
                        help="how embeddings pool the prompt's hidden states: last (token), mean, cls (the first "
                        "token) (default: what the model's sentence-transformers files say, else last)")
    engine.add_argument("--batch-invariant", "--enable-deterministic-inference", action="store_true",
                        help="call prefill and decode one sequence at a time, so that a request's tokens and "
                        "logprobs never depend on what else is running; builds with the CPU kernels are "
                        "batch-invariant without it (docs/serving.md: what it costs)")
    engine.add_argument("--no-device-sampling", dest="device_sampling", action="store_false",
                        help="sample every token on the host, even with a build that chooses them on the device "
                        "(sample_bs<N>, a GPU build's default: docs/gpu.md)")
    engine.add_argument("--max-queue", type=_non_negative_int, default=defaults.max_queue, metavar="N",
                        help="requests waiting before new ones get 503 (default: %(default)s)")
    engine.add_argument("--grammar-compile-timeout", type=_positive_float, default=defaults.grammar_compile_seconds,
                        metavar="SECONDS", help="longest a request's structured-output grammar may take to compile "
                        "(off the event loop) before the request gets a 400 (default: %(default)s)")
    engine.add_argument("--max-running", type=_positive_int, default=defaults.max_running, metavar="N",
                        help="sequences decoding at once (default: %(default)s)")
    engine.add_argument("--max-prefill-tokens", type=_non_negative_int, default=defaults.prefill_token_budget,
                        metavar="N", help="while requests stream, at most N prompt tokens per prefill step, "
                        "the longest pause between their tokens (default: %(default)s; 0: no cap; raise it on a GPU)")
    engine.add_argument("--apd-verifier", type=Path, metavar="PATH",
                        help="with a diffusion model: an autoregressive model with the same tokenizer that "
                        "verifies APD drafts (an artifacts directory, or an HF directory / .gguf built first)")
    speculative = SpeculativeConfig("ngram")
    engine.add_argument("--speculative-model", metavar="ngram|PATH",
                        help="speculative decoding: 'ngram' drafts by prompt lookup; a path is a small draft "
                        "model with the same tokenizer (an artifacts directory, or an HF directory / .gguf built "
                        "first). Off by default")
    engine.add_argument("--num-speculative-tokens", type=_positive_int, default=speculative.num_tokens, metavar="K",
                        help="draft tokens verified per decode step (default: %(default)s)")
    engine.add_argument("--prompt-lookup-max", type=_positive_int, default=speculative.prompt_lookup_max,
                        metavar="N", help="with ngram: the longest n-gram looked up (default: %(default)s)")
    engine.add_argument("--prompt-lookup-min", type=_positive_int, default=speculative.prompt_lookup_min,
                        metavar="N", help="with ngram: the shortest n-gram looked up (default: %(default)s)")
    engine.add_argument("--speculative-disable-by-batch-size", type=_non_negative_int,
                        default=speculative.disable_by_batch_size, metavar="N",
                        help="draft only while a decode batch has at most N rows; the drafts share the widest "
                        "decode's rows with the batch (default: %(default)s; 0: while that decode has a row to spare)")
    engine.add_argument("--kv-events", action="store_true",
                        help="publish the prefix cache's KV events (pages stored and evicted) for cache-aware "
                        "routers: gRPC SubscribeKvEvents, and ZMQ with --kv-events-endpoint")
    engine.add_argument("--kv-events-endpoint", metavar="URL",
                        help="also send them over ZMQ in vLLM's format, e.g. tcp://*:5557 (implies --kv-events; "
                        "needs the events extra)")
    engine.add_argument("--kv-events-topic", default="", metavar="TOPIC", help="the ZMQ topic (default: none)")
    engine.add_argument("--host-kv-size", type=_byte_size, default=defaults.host_kv_bytes, metavar="BYTES",
                        help="keep evicted prefix-cache pages in this much host memory (e.g. 4GiB) and copy them "
                        "back instead of recomputing them (default: off; the CPU device)")
    engine.add_argument("--host-kv-write-policy", choices=HOST_WRITE_POLICIES, default=defaults.host_kv_write_policy,
                        help="write_through: copy a page to host memory as it is cached; write_back: when the device "
                        "evicts it (default: %(default)s)")
    engine.add_argument("--kv-cache-dir", metavar="DIR",
                        help="keep cached prefixes in files here too, so a restarted server reuses them (uses the "
                        "host tier: --host-kv-size, by default as large as the device's cache)")
    size = engine.add_mutually_exclusive_group()
    size.add_argument("--kv-cache-pages", type=_non_negative_int, default=defaults.page_count, metavar="N",
                      help="KV-cache pages (default: the export's device_block_count, cut down where it would not "
                      f"fit in {DEFAULT_MEMORY_FRACTION * 100:.0f}%% of the device's memory with the weights loaded)")
    size.add_argument("--kv-cache-memory", type=_cache_memory, metavar="SIZE|FRACTION",
                      help="the KV cache's size in bytes (4GiB, 512MiB), or a fraction such as 0.8: the share of the "
                      "device's memory the server may use once the weights are loaded, the cache taking the rest")
    size.add_argument("--gpu-memory-utilization", type=_memory_fraction, metavar="FRACTION",
                      help="vLLM's name for --kv-cache-memory FRACTION (on any device)")
    scale = parser.add_argument_group("data parallel (Ray Serve; needs the ray extra)")
    scale.add_argument("--data-parallel", type=_positive_int, metavar="N",
                       help="N engine replicas, each with its own KV cache, behind one front that sends a request "
                       "to the replica holding its prefix")
    scale.add_argument("--ray-address", metavar="ADDR",
                       help="join this Ray cluster ('auto', or host:port of `ray start --head`); default: start one here")
    scale.add_argument("--replica-cpus", type=_positive_float, default=0.0, metavar="C",
                       help="cores per replica (default: this machine's cores shared evenly)")
    scale.add_argument("--replica-gpus", type=_positive_float, default=0.0, metavar="G", help="GPUs per replica")
    scale.add_argument("--autoscale", type=_replica_bounds, metavar="MIN:MAX",
                       help="let Ray add and remove replicas between MIN and MAX (starting at --data-parallel)")
    scale.add_argument("--target-ongoing-requests", type=_positive_int, default=16, metavar="N",
                       help="with --autoscale: the in-flight requests per replica Ray scales towards (default: %(default)s)")
    scale.add_argument("--routing", choices=POLICIES, default=RoutingPolicy().name,
                       help="cache_aware (the replica holding the prompt's prefix while loads are even) or "
                       "round_robin (default: %(default)s)")
    parser.set_defaults(run=run_serve)


def _replica_bounds(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    try:
        bounds = int(low), int(high)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN:MAX, got {text}") from None
    if not 0 < bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"need 0 < MIN <= MAX, got {text}")
    return bounds


def needs_build(args) -> bool:
    return not (args.vmfb or args.params or args.config or args.artifacts)


def resolve_in_child(args):
    """resolve_artifacts in a spawned process: building imports torch, which the server must not keep."""
    return build_in_child(args)()


def build_in_child(args):
    """resolve_artifacts(args) to run in a spawned process, which `cancel()` stops (cli/child_build.py)."""
    from .child_build import ChildBuild

    return ChildBuild(resolve_artifacts, args, args.model or "the default model")


def verifier_artifacts(args):
    """The APD verifier's artifacts (see second_model_artifacts)."""
    return None if args.apd_verifier is None else second_model_artifacts(args, Path(args.apd_verifier), "APD verifier")


def speculative_config(args):
    """Speculative decoding's settings from the flags; None when --speculative-model is not given."""
    if args.speculative_model is None:
        return None
    if args.batch_invariant:
        raise SystemExit("kiln serve: --speculative-model verifies several tokens of a sequence in one call; "
                         "--batch-invariant calls one row at a time: choose one")
    draft = None
    if args.speculative_model != "ngram":
        draft = second_model_artifacts(args, Path(args.speculative_model), "speculative model")
    try:
        return SpeculativeConfig("draft_model" if draft else "ngram", args.num_speculative_tokens, draft,
                                 args.prompt_lookup_max, args.prompt_lookup_min,
                                 args.speculative_disable_by_batch_size)
    except ValueError as error:
        raise SystemExit(f"kiln serve: {error}") from None


def second_model_artifacts(args, path: Path, label: str):
    """A second model's artifacts (an APD verifier, a draft model): a directory of them as it
    is, or a model built (in a child process) before the server starts."""
    from kiln.models.packaged import resolve_model_path
    from kiln.runtime.contract import CONFIG_FILE

    path = resolve_model_path(path)
    if not path.exists():
        from kiln.runtime.errors import ModelLoadError

        raise ModelLoadError(f"{label} path {path} does not exist")
    choice = argparse.Namespace(**{**vars(args), "vmfb": None, "params": None, "config": None, "tokenizer": None,
                                   "embeddings": False, "enable_lora": False, "lora": []})
    if (path / CONFIG_FILE).is_file():
        choice.artifacts, choice.model = path, None
        return resolve_artifacts(choice)
    choice.artifacts, choice.model = None, path
    return resolve_in_child(choice)


def default_model_names(args, artifacts) -> list[str]:
    """The names /v1/models lists, the first the model's: without --served-model-name, a model's
    own name (its directory's, or its GGUF file's without the extension)."""
    if args.served_model_name:
        return list(args.served_model_name)
    if args.model:
        model = Path(args.model)
        return [model.stem if model.suffix.lower() == ".gguf" else model.resolve().name]
    if needs_build(args):
        from kiln.models.default_model import DEFAULT_MODEL_NAME

        return [DEFAULT_MODEL_NAME]
    return [Path(artifacts.config).resolve().parent.name]


def read_chat_template(value: str | None) -> str | None:
    if value is None:
        return None
    if "{{" in value or "{%" in value:  # the template itself (too long to be a file name, often)
        return value
    path = Path(value)
    try:
        if path.is_file():
            return path.read_text()
    except OSError:
        pass
    from kiln.runtime.chat import ChatTemplateError

    raise ChatTemplateError(f"chat template file {value} does not exist")


def run_serve(args) -> int:
    from kiln.runtime.program import quiet_exit
    from kiln.server.main import serve

    quiet_exit()

    if args.model is not None:
        from kiln.models.packaged import resolve_model_path
        from kiln.runtime.errors import ModelLoadError

        args.model = resolve_model_path(args.model)
        if not args.model.exists():
            raise ModelLoadError(f"model path {args.model} does not exist")
    # A model to build is built after the server is up, so /health answers 503 meanwhile.
    prepare = build_in_child(args) if needs_build(args) else None
    artifacts = None if prepare else resolve_artifacts(args)
    api_keys = list(args.api_key) + [k for k in os.environ.get("KILN_API_KEY", "").split(",") if k.strip()]
    settings = ServerSettings(
        host=args.host,
        port=args.port,
        grpc_port=args.grpc_port,
        kv_events_endpoint=args.kv_events_endpoint,
        kv_events_topic=args.kv_events_topic,
        served_model_names=tuple(default_model_names(args, artifacts)),
        # The path a model was given by is taken too, as vLLM would name the model by it.
        model_aliases=(str(args.model),) if args.model and not args.served_model_name else (),
        chat_template=read_chat_template(args.chat_template),
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        api_keys=tuple(k.strip() for k in api_keys),
        cors_origins=tuple(args.cors_origin),
        rate_limit=args.rate_limit,
        max_body_bytes=args.max_body_bytes,
        max_prompt_chars=args.max_prompt_chars,
        header_timeout=args.header_timeout,
        keep_alive_timeout=args.keep_alive_timeout,
        max_connections=args.max_connections,
        grace_seconds=args.grace_period,
        log_requests=not args.no_access_log,
    )
    service_config = ServiceConfig(
        artifacts,
        device=device_name(args),
        parameter_memory=args.parameter_memory,
        prefix_sharing=args.prefix_sharing,
        **kv_cache_size(args),
        max_running=args.max_running,
        max_queue=args.max_queue,
        grammar_compile_seconds=args.grammar_compile_timeout,
        prefill_token_budget=args.max_prefill_tokens,
        apd_verifier=verifier_artifacts(args),
        speculative=speculative_config(args),
        kv_events=args.kv_events or bool(args.kv_events_endpoint),
        host_kv_bytes=args.host_kv_size,
        host_kv_write_policy=args.host_kv_write_policy,
        kv_cache_dir=args.kv_cache_dir,
        sampling_defaults=args.sampling_defaults,
        pooling=args.pooling or "",
        batch_invariant=args.batch_invariant,
        device_sampling=args.device_sampling,
        lora_adapters=dict(args.lora),
    )
    if args.data_parallel:
        return run_data_parallel(args, service_config, settings)
    return serve(service_config, settings, log_level=args.log_level, prepare=prepare)


def kv_cache_size(args) -> dict:
    """ServiceConfig's fields for the KV cache's size, from whichever option gave it."""
    memory = args.kv_cache_memory
    return {"page_count": args.kv_cache_pages,
            "memory_budget_bytes": memory if isinstance(memory, int) else 0,
            "memory_fraction": args.gpu_memory_utilization or (memory if isinstance(memory, float) else 0.0)}


def run_data_parallel(args, service_config: ServiceConfig, settings: ServerSettings) -> int:
    """The same service on N Ray Serve replicas; the artifacts are built first (every replica loads them)."""
    try:
        from kiln.server.replicas.launcher import DataParallelConfig, serve_data_parallel
    except ImportError as error:
        raise SystemExit(f"kiln serve: --data-parallel needs Ray Serve (pip install 'kiln[ray]'): {error}") from None
    from kiln.server.main import configure_logging

    configure_logging(args.log_level)
    if service_config.artifacts is None:
        service_config = dataclasses.replace(service_config, artifacts=resolve_in_child(args))
    if service_config.parameter_memory == "auto":
        # Replicas on one machine share the file's pages, where private memory would hold a copy each.
        service_config = dataclasses.replace(service_config, parameter_memory="mapped")
    low, high = args.autoscale or (None, None)
    try:
        config = DataParallelConfig(
            replicas=args.data_parallel, min_replicas=low, max_replicas=high,
            target_ongoing_requests=args.target_ongoing_requests, replica_cpus=args.replica_cpus,
            replica_gpus=args.replica_gpus, ray_address=args.ray_address, routing=RoutingPolicy(args.routing))
    except ValueError as error:
        raise SystemExit(f"kiln serve: {error}") from None
    return serve_data_parallel(service_config, settings, config, log_level=args.log_level)
