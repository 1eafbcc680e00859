"""``unimae serve``: the OpenAI-compatible server (embeddings, completions, chat; RAG with --index).

``--engine torch`` (default) runs the model in PyTorch; ``--engine llama.cpp --gguf FILE`` serves a GGUF written
by ``unimae export --format gguf`` from one llama.cpp model (:mod:`unimae.serving.llamacpp_engine`).

Every :class:`~unimae.serving.config.ServerConfig` field is a flag, honoured by both engines (the same routes,
limits and 429s). With ``--engine torch``, concurrent generations are batched in flight
(``--max-batch-generations 8`` decoded together; ``--no-continuous-batching`` runs each on its own thread,
``--max-concurrent-generations`` at once); with ``--engine llama.cpp`` as many hold a generation slot and
llama.cpp decodes up to ``--slots`` of them together, each request (prompt + new tokens, or one embedding input)
within ``--context`` tokens.

The server limits glibc malloc to two arenas before anything else (:func:`~unimae.runtime.memory.limit_arenas`;
``$MALLOC_ARENA_MAX`` overrides): its worker threads would otherwise each keep the free memory of their largest
request (docs/serving.md, "Memory").
"""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import fields
from pathlib import Path

from unimae.cli.arguments import add_command, add_model_arguments, default_model, inference_precisions
from unimae.serving.config import ServerConfig, check_api_key, model_id
from unimae.training.config import add_dataclass_arguments

logger = logging.getLogger(__name__)
DEFAULT_MAX_LENGTH = 512  # --max-length without --index (with one: the index's)


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    parser = add_command(
        sub, "serve", "OpenAI-compatible server: embeddings, completions, chat (+ RAG with --index).", _serve
    )
    add_model_arguments(parser, from_index=True)
    inference_precisions(parser)
    parser.add_argument(
        "--engine",
        default="torch",
        choices=("torch", "llama.cpp"),
        help="torch: the model in PyTorch; llama.cpp: an exported GGUF (--gguf) in llama.cpp (pip install xllamacpp).",
    )
    parser.add_argument("--gguf", help="llama.cpp engine: the file written by `unimae export --format gguf`.")
    parser.add_argument(
        "--threads", type=int, help="llama.cpp engine: CPU threads (default: all cores; fewer on a shared machine)."
    )
    parser.add_argument("--slots", type=int, help="llama.cpp engine: requests decoded together (default: 4).")
    parser.add_argument(
        "--context",
        type=int,
        help="llama.cpp engine: tokens per request: a completion/chat/RAG prompt plus its max_tokens (400 beyond), "
        "and the longest embedding input (--max-length); llama.cpp's KV cache holds --slots x this many tokens. "
        "At most the GGUF's trained context (default: 2048, or the trained context if smaller).",
    )
    parser.add_argument("--index", help="Also serve POST /v1/rag over this index (its model and adapter).")
    parser.add_argument("--host", default="127.0.0.1", help="Address to bind; anything but loopback warns.")
    parser.add_argument(
        "--port", type=port_argument, default=8000, help="Port to listen on (0-65535; 0: any free port)."
    )
    parser.add_argument(
        "--max-length",
        type=int,
        help=f"Tokens per embedding input (with EOS) (default: {DEFAULT_MAX_LENGTH}; with --index, the index's: its "
        "passages were embedded at that length, so another value is an error).",
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="Merge the LoRA into bf16 weights: faster (esp. generation), embeddings slightly less faithful.",
    )
    add_dataclass_arguments(parser, ServerConfig)
    parser.add_argument(
        "--api-key-file",
        help="Read the API key from this file (stripped): unlike --api-key, it is not visible in `ps`. "
        "Without either, $UNIMAE_API_KEY is used.",
    )


def _serve(args: argparse.Namespace) -> int:
    from unimae.runtime import memory

    memory.limit_arenas(2)  # before the threads that would make the arenas: the model's, the workers'
    values = {f.name: getattr(args, f.name) for f in fields(ServerConfig)}
    values["api_key"] = check_api_key(resolve_api_key(args.api_key, args.api_key_file))  # before the model loads
    llamacpp_only = (args.gguf, args.threads, args.slots, args.context)
    if args.engine == "torch" and any(value is not None for value in llamacpp_only):
        raise ValueError(
            "--gguf, --threads, --slots and --context are for --engine llama.cpp: serve a GGUF with --engine "
            "llama.cpp --gguf FILE"
        )
    check_port(args.host, args.port)  # before the model loads: a port in use fails in a second, not after it
    args.max_length = resolve_max_length(args.max_length, args.index)
    if args.engine == "llama.cpp":
        app, config = _llamacpp_app(args, values)
    else:
        from unimae.serving.app import create_app

        encoder, index, model = _load_encoder(args)
        if values["model_name"] == ServerConfig.model_name:  # not given: name it after the model
            values["model_name"] = model_id(model)
        config = ServerConfig(**values)
        app = create_app(encoder, config, index)
    _warn_if_exposed(args.host, config.api_key is not None)
    sock = listen(args.host, args.port)  # bound now: the line below names the port it holds (0: the system's pick)
    url = f"http://{f'[{args.host}]' if ':' in args.host else args.host}:{sock.getsockname()[1]}"
    print(f"unimae serving {config.model_name} on {url} (Ctrl-C stops after in-flight requests)", flush=True)
    run_uvicorn(app, sock, config)
    return 0


def run_uvicorn(app, sock, config: ServerConfig) -> None:
    """Serve ``app`` with uvicorn on the bound socket ``sock`` until Ctrl-C (in-flight requests finish, 30 s at
    most)."""
    import uvicorn

    from unimae.serving.header_timeout import header_timeout_protocol

    options = uvicorn.Config(
        app,
        log_level="warning",
        timeout_graceful_shutdown=30,
        timeout_keep_alive=config.keep_alive_s,
        http=header_timeout_protocol(config.header_timeout_s),
    )
    uvicorn.Server(options).run(sockets=[sock])


def _llamacpp_app(args: argparse.Namespace, values: dict) -> tuple:
    """(app, config) of the llama.cpp engine serving ``--gguf`` (and ``--index``, built from the same adapter)."""
    from unimae.serving.llamacpp_engine import LlamaCppModel, create_llamacpp_app

    if not args.gguf:
        raise ValueError("--engine llama.cpp serves --gguf FILE; write one with `unimae export --format gguf`")
    if args.model or args.adapter or args.merge or args.device != "auto" or args.precision != "auto":
        raise ValueError(
            "--model, --adapter, --merge, --device and --precision are for --engine torch; the GGUF already holds "
            "the merge and its weight type (llama.cpp runs it on the CPU)"
        )
    index = None
    if args.index:
        from unimae.retrieval.disk_index import open_index

        index = open_index(args.index)
    model = LlamaCppModel(
        args.gguf, max_length=args.max_length, threads=args.threads, parallel=args.slots or 4, context=args.context
    )
    if values["model_name"] == ServerConfig.model_name:  # not given: the model it was exported from
        values["model_name"] = model.name
    config = ServerConfig(**values)
    return create_llamacpp_app(model, config, index), config


def _load_encoder(args: argparse.Namespace) -> tuple:
    """(encoder, index or None, model name): the index's model and adapter with --index, else --model."""
    merge = True if args.merge else None
    if args.index:
        from unimae.retrieval.rag import load_index_and_encoder

        encoder, index = load_index_and_encoder(
            args.index, args.model, args.adapter, args.precision, merge, device=args.device
        )
        return encoder, index, args.model or index.manifest["model"]
    from unimae.encoder import Encoder

    model = args.model or default_model(args.adapter)
    encoder = Encoder.from_pretrained(
        model,
        adapter=args.adapter,
        max_length=args.max_length,
        precision=args.precision,
        merge=merge,
        device=args.device,
    )
    return encoder, None, model


def port_argument(value: str) -> int:
    """``--port``: an integer from 0 to 65535 (0: any free port), else a usage error before anything loads."""
    try:
        port = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid port {value!r}: give a number from 0 to 65535") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port {port} is out of range: give a number from 0 to 65535")
    return port


def check_port(host: str, port: int) -> None:
    """OSError naming the address and what to do unless the server can listen on ``host``:``port`` (in use, an
    address this machine does not have, a privileged port): every address ``host`` resolves to bound with
    ``SO_REUSEADDR``, then let go. The check before the model loads; :func:`listen` binds the one it serves on."""
    import socket

    try:
        addresses = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as err:
        raise OSError(f"cannot listen on {host}:{port}: {err.strerror or err}; check --host") from None
    for family, kind, proto, _, address in dict.fromkeys(addresses):
        with socket.socket(family, kind, proto) as sock:
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            _bind(sock, address, host, port)


def listen(host: str, port: int):
    """The socket the server serves on, bound as uvicorn binds its own (IPv6 where ``host`` has a ':', else IPv4;
    ``SO_REUSEADDR``): nothing can take the port between this and the serving, and with ``port`` 0 its
    ``getsockname()`` names the port the system picked. Errors as :func:`check_port`'s."""
    import socket

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        _bind(sock, (host, port), host, port)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def _bind(sock, address, host: str, port: int) -> None:
    """``sock.bind(address)`` with ``SO_REUSEADDR``, or an OSError saying what to do about ``host``:``port``."""
    import errno
    import socket

    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as err:
        hint = {
            errno.EADDRINUSE: "another process listens there: stop it or pass another --port",
            errno.EACCES: "ports below 1024 need privileges: pass another --port",
            errno.EADDRNOTAVAIL: "this machine has no such address: check --host",
        }.get(err.errno, "check --host and --port")
        raise OSError(f"cannot listen on {host}:{port}: {err.strerror or err}; {hint}") from None


def resolve_max_length(given: int | None, index: str | None) -> int:
    """``--max-length``: as given, else :data:`DEFAULT_MAX_LENGTH`; with ``--index``, the length its passages were
    embedded at (queries are embedded the same way), and a given value that differs is an error, before any model
    loads."""
    if not index:
        return DEFAULT_MAX_LENGTH if given is None else given
    from unimae.retrieval.index import finished_manifest

    built = finished_manifest(Path(index)).get("max_length")
    if built is None:  # not recorded: the loaders say what is wrong with the index
        return DEFAULT_MAX_LENGTH if given is None else given
    if given is not None and given != built:
        raise ValueError(
            f"--max-length {given} differs from the index's max_length {built}: the passages in {index} were "
            f"embedded at {built} tokens and queries must be embedded the same way. Leave --max-length out (the "
            f"index's {built} is used), or rebuild the index with `unimae index --max-length {given}`"
        )
    return int(built)


def resolve_api_key(from_argv: str | None, key_file: str | None) -> str | None:
    """The server's API key: from ``key_file``, else the command line (warned: other users see it in
    ``ps``), else ``$UNIMAE_API_KEY``; None when none is set."""
    if from_argv and key_file:
        raise ValueError("pass --api-key or --api-key-file, not both")
    if key_file:
        if not Path(key_file).is_file():
            raise FileNotFoundError(f"API key file {key_file} does not exist")
        key = Path(key_file).read_text(encoding="utf-8").strip()
        if not key:
            raise ValueError(f"API key file {key_file} is empty")
        return key
    if from_argv:
        logger.warning(
            "--api-key on the command line is visible to other users (ps, shell history); "
            "use --api-key-file or $UNIMAE_API_KEY"
        )
        return from_argv
    return os.environ.get("UNIMAE_API_KEY") or None


def _warn_if_exposed(host: str, has_key: bool) -> None:
    import ipaddress

    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback:
        logger.warning(
            "binding %s exposes the server beyond this machine%s",
            host,
            "" if has_key else " WITHOUT an API key (pass --api-key-file or set $UNIMAE_API_KEY)",
        )
