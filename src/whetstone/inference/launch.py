"""Build the server `whetstone serve` runs: model and tokenizer from a Hugging Face folder, the
engine, the weight follower (if a store is configured) and the HTTP app; and run it on a socket
bound first, so a busy port is reported before anything is loaded or announced."""

from __future__ import annotations

import errno
import logging
import socket
import sys
from pathlib import Path

from whetstone.errors import ConfigError, WhetstoneError
from whetstone.inference.config import ServeConfig

GIL_SWITCH_INTERVAL_S = 0.0005  # bench pipeline, alternating runs: +4.5% samples/s against 0.005
FILES_BESIDE_CONNECTIONS = 256
"""Open files the server needs besides its connections (weights, the stores, pipes, threads)."""


def build_app(config: ServeConfig):
    from whetstone.config import expand_path
    from whetstone.inference.engine import Engine
    from whetstone.inference.server import create_app
    from whetstone.inference.swap import WeightFollower
    from whetstone.model.hf import check_vocab_fits, load_hf, read_hf_config
    from whetstone.sync import Subscriber, WeightStore
    from whetstone.tokenizer import Tokenizer
    from whetstone.utils.runtime import configure_process

    check_startup(config)
    configure_process(config.threads)
    folder = expand_path(config.model_path)
    vocab_size = read_hf_config(folder).vocab_size
    tokenizer = Tokenizer.load(folder)
    check_vocab_fits(tokenizer.vocab_size, str(folder / "tokenizer.json"), vocab_size, str(folder / "config.json"))
    model = load_hf(folder)
    engine = Engine(
        model,
        config.engine,
        eos_token_ids=(tokenizer.im_end_id, tokenizer.endoftext_id),
        decode=tokenizer.decode,
        version=config.weight_version,
    )
    follower = None
    if config.sync is not None:
        subscriber = Subscriber(WeightStore.open(config.sync, create=False), config.sync, name=f"serve:{config.port}")
        follower = WeightFollower(subscriber, engine, poll_seconds=config.sync.poll_interval)
    name = config.model_name or Path(config.model_path).resolve().name
    return create_app(engine, tokenizer, config, name, follower)


def check_startup(config: ServeConfig) -> None:
    """What can be wrong before anything is loaded: no model folder, a device this machine lacks."""
    from whetstone.utils.device import resolve_device

    if not config.model_path:
        raise ConfigError(
            "model_path is not set: point it at a Hugging Face model folder "
            "(config.json, model.safetensors, tokenizer.json)"
        )
    resolve_device(config.engine.device)


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (uvicorn listens on it once the app is built; until then a
    client is refused, not kept waiting); raises naming the port when it is taken."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart need not wait out TIME_WAIT
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRINUSE:
            raise WhetstoneError(
                f"port {port} is in use on {host}: stop what listens there or choose another port (--set port=N)"
            ) from None
        raise WhetstoneError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None
    return sock


def make_room_for_connections(connections: int) -> None:
    """Raise this process's soft open-files limit, within the hard one, so `connections` sockets
    fit beside the server's own files: past `max_connections` uvicorn answers 503 rather than
    the process failing to accept. A hard limit too low for them is a `ConfigError`."""
    import resource

    need = connections + FILES_BESIDE_CONNECTIONS
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return
    if hard != resource.RLIM_INFINITY and hard < need:
        raise ConfigError(
            f"max_connections = {connections} needs about {need} open files, and this process may "
            f"open at most {hard} (ulimit -Hn): lower max_connections or raise the limit"
        )
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


def uvicorn_config(app, config: ServeConfig):
    """How uvicorn runs the app: at most `max_connections` connections served at once (503
    past them), `listen_backlog` queued by the kernel, a request's headers in within
    `header_timeout_s` (`connections`), no access log (the app logs requests)."""
    import uvicorn

    from whetstone.inference.connections import with_header_deadline

    return uvicorn.Config(
        app,
        http=with_header_deadline(config.header_timeout_s),
        host=config.host,
        port=config.port,
        log_level="warning",
        access_log=False,
        limit_concurrency=config.max_connections,
        backlog=config.listen_backlog,
    )


def serve(config: ServeConfig) -> None:
    """Run the server in this process until interrupted."""
    import uvicorn

    from whetstone.fleet.registry import api_root

    check_startup(config)
    make_room_for_connections(config.max_connections)
    sock = bind(config.host, config.port)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    app = build_app(config)
    # The engine thread takes the GIL back after every torch op; with Python's default 5 ms
    # interval the HTTP thread can hold it off that long whenever it is busy.
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    print(f"whetstone serving on {api_root(config.host, config.port)}", flush=True)
    server = uvicorn.Server(uvicorn_config(app, config))
    server.run(sockets=[sock])
