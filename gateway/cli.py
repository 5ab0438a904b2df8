"""The `specgate` command.

Every subcommand imports what it needs when it runs: `specgate --help` and
`specgate X --help` must not pay for MLX, mlx-lm or transformers (seconds).
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import socket

    from gateway.config import Config

# `serve` exits with this when it cannot start serving: a refused bind, an
# address taken, a failed startup (uvicorn's own STARTUP_FAILURE code).
EXIT_CANNOT_LISTEN = 3


def _unsafe_bind(config: Config) -> str | None:
    """Why serving on this address without keys is refused, or None if fine.
    Checked before anything binds or loads; KeyFileError for a bad keys file."""
    from gateway.auth import is_loopback
    from gateway.keys import read_keys

    host, path = config.server.host, config.auth.keys_path
    if is_loopback(host) or read_keys(path):
        return None
    return (
        f"specgate: refusing to listen on {host}: it is reachable from other machines and no "
        f"API keys are configured ({path} has none), so anyone on the network could use it.\n"
        f"Add a key first:  specgate keys add NAME   (then send it as 'Authorization: Bearer "
        f"<key>' or 'x-api-key: <key>'),\nor listen on loopback only:  --host 127.0.0.1"
    )


def _keys_path(args: argparse.Namespace):
    from pathlib import Path

    from gateway.config import default_config, load_config

    if args.keys_file:
        return Path(args.keys_file).expanduser()
    config = load_config(args.config) if args.config else default_config()
    return config.auth.keys_path


def _keys(args: argparse.Namespace) -> int:
    from gateway.config import ConfigError
    from gateway.keys import KeyFileError, add_key, read_keys, revoke_key

    try:
        path = _keys_path(args)
        if args.action == "add":
            models = None  # every model; --models "" makes a key for /metrics alone
            if args.models is not None:
                models = [m.strip() for m in args.models.split(",") if m.strip()]
            key = add_key(path, args.name, models=models, rpm=args.rpm, tpm=args.tpm,
                          max_concurrent=args.max_concurrent, admin=args.admin)
            print(f"Added key '{args.name}' to {path}. This is the only time it is shown; "
                  "a running server picks it up on POST /admin/reload or restart:", file=sys.stderr)
            print(key)
        elif args.action == "list":
            _print_keys(read_keys(path))
        else:
            if not revoke_key(path, args.name):
                print(f"specgate: no key named '{args.name}' in {path}", file=sys.stderr)
                return 1
            print(f"Revoked '{args.name}'. A running server stops accepting it on "
                  "POST /admin/reload or restart.", file=sys.stderr)
    except (KeyFileError, ConfigError) as e:
        print(f"specgate: {e}", file=sys.stderr)
        return 2
    return 0


def _print_keys(records) -> None:
    rows = [("NAME", "KEY", "MODELS", "RPM", "TPM", "CONCURRENT", "ADMIN", "CREATED")]
    for r in records:
        models = "*" if r.models is None else ",".join(r.models) or "(none)"
        limits = (str(v) if v is not None else "-" for v in (r.rpm, r.tpm, r.max_concurrent))
        rows.append((r.name, f"sg-{r.key_id}.…", models, *limits, "yes" if r.admin else "no",
                     r.created))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


def _listen(host: str, port: int) -> list[socket.socket]:
    """Sockets bound to host:port (every address the name resolves to, as
    uvicorn's own bind would), or OSError.

    Bound before anything loads, and handed to uvicorn: uvicorn binds only
    after the app's startup, which starts loading the models, so a taken port
    used to end the process with a model loader thread still running MLX.
    """
    import socket

    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                               flags=socket.AI_PASSIVE)
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            # As uvicorn and asyncio do: a restart may reuse a port whose
            # old connections are still in TIME_WAIT.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def _cannot_listen(host: str, port: int, err: OSError) -> str:
    reason = err.strerror or str(err)
    reason = reason[:1].lower() + reason[1:]
    hint = " (stop what uses it, or pick another --port)" if "in use" in reason else ""
    return f"specgate: cannot listen on {host}:{port}: {reason}{hint}"


def _serve(args: argparse.Namespace) -> int:
    from gateway.config import ConfigError, default_config, load_config

    try:
        config = load_config(args.config) if args.config else default_config()
    except ConfigError as e:
        print(f"specgate: bad config\n{e}", file=sys.stderr)
        return 2
    if args.host:
        config.server.host = args.host
    if args.port is not None:
        config.server.port = args.port
    from gateway.keys import KeyFileError

    try:
        refusal = _unsafe_bind(config)
    except KeyFileError as e:  # the same exit as when the app reads the file
        print(f"specgate: {e}", file=sys.stderr)
        return 2
    if refusal:
        print(refusal, file=sys.stderr)
        return EXIT_CANNOT_LISTEN
    host, port = config.server.host, config.server.port
    try:
        sockets = _listen(host, port)
    except OSError as e:
        print(_cannot_listen(host, port, e), file=sys.stderr)
        return EXIT_CANNOT_LISTEN
    try:
        return _run_server(config, sockets)
    finally:
        for sock in sockets:
            sock.close()


def _run_server(config: Config, sockets: list[socket.socket]) -> int:
    import logging

    from gateway.app import create_app
    from gateway.keys import KeyFileError
    from gateway.server import make_server

    logging.basicConfig(
        level=config.server.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # httpx logs every call specgate makes to its llama-servers at INFO.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.root.level))
    try:
        app = create_app(config)
    except KeyFileError as e:
        print(f"specgate: {e}", file=sys.stderr)
        return 2
    server = make_server(app, config)  # bounded headers, a graceful drain (gateway/server.py)
    # Given sockets, uvicorn says nothing about where it listens.
    for sock in sockets:
        host, port = sock.getsockname()[:2]
        logging.getLogger("gateway.cli").info(
            "listening on http://%s:%d", f"[{host}]" if ":" in host else host, port)
    server.run(sockets=sockets)
    # As uvicorn.run: an app whose startup failed never started serving.
    return 0 if server.started else EXIT_CANNOT_LISTEN


def _inspect(args: argparse.Namespace) -> int:
    from engines.builders.builtin_models import builtin_path
    from engines.checkpoints.inspect import run_cli

    return run_cli(args.model, args.target, args.json, builtin=builtin_path)


def _demo_model(args: argparse.Namespace) -> int:
    from engines.builders.demo_training import run_cli

    return run_cli(args)


def _demo_drafter(args: argparse.Namespace) -> int:
    from engines.builders.dflash_training import run_cli

    return run_cli(args)


def _install_llama_server(args: argparse.Namespace) -> int:
    from engines.llamacpp.install import run_cli

    return run_cli(force=args.force, jobs=args.jobs)


def _tune(args) -> int:
    from engines.builders.builtin_models import UnknownBuiltin
    from engines.mlx_load import CheckpointLoadError
    from gateway.tuning import run_cli

    try:
        return run_cli(args)
    except (UnknownBuiltin, CheckpointLoadError) as e:  # what was named is not a model here
        print(f"specgate tune: {e}", file=sys.stderr)
        return 2


def _config(args: argparse.Namespace) -> int:
    import json

    from gateway.config import ConfigError, json_schema, load_config

    if args.action == "schema":
        print(json.dumps(json_schema(), indent=2))
        return 0
    try:  # check: everything serve would check before loading a model
        config = load_config(args.file)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    print(f"{args.file}: ok ({len(config.models)} model{'s' * (len(config.models) != 1)}: "
          f"{', '.join(m.id for m in config.models)})")  # fmt: skip
    return 0


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("specgate")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


class _VersionAction(argparse.Action):
    """--version, reading the installed package's metadata only when asked."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"specgate {_version()}")
        parser.exit()


def main(argv: list[str] | None = None) -> int:
    from engines.builders import training_args

    parser = argparse.ArgumentParser(
        prog="specgate", description="An OpenAI/Anthropic-compatible LLM gateway over "
        "speculative-decoding engines (MLX, llama.cpp).")
    parser.add_argument("--version", action=_VersionAction, help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve the OpenAI-compatible API")
    serve.add_argument("--config", help="YAML config (default: the embedded demo model)")
    serve.add_argument("--host", help="bind address (overrides the config)")
    serve.add_argument("--port", type=int, help="port (overrides the config)")
    serve.set_defaults(run=_serve)
    keys = sub.add_parser("keys", help="API keys: add, list, revoke")
    where = argparse.ArgumentParser(add_help=False)
    where.add_argument("--config", help="YAML config whose auth.keys_file to use")
    where.add_argument("--keys-file", help="the keys file (default: $SPECGATE_HOME/keys)")
    actions = keys.add_subparsers(dest="action", required=True)
    add = actions.add_parser("add", parents=[where], help="make a key; it is printed once")
    add.add_argument("name", help="who or what uses it (shown in metrics and logs)")
    add.add_argument("--models",
                     help='comma-separated model ids it may use (default: all; "": none)')
    add.add_argument("--rpm", type=int, help="requests per minute")
    add.add_argument("--tpm", type=int, help="prompt + completion tokens per minute")
    add.add_argument("--max-concurrent", type=int, help="requests in flight at once")
    add.add_argument("--admin", action="store_true", help="may call /admin/* endpoints")
    actions.add_parser("list", parents=[where], help="list keys (no secrets)")
    revoke = actions.add_parser("revoke", parents=[where], help="delete a key by name")
    revoke.add_argument("name")
    keys.set_defaults(run=_keys)
    config = sub.add_parser("config", help="the config file: its JSON Schema, or check one")
    config_actions = config.add_subparsers(dest="action", required=True)
    config_actions.add_parser("schema", help="print the JSON Schema (for editors)")
    check = config_actions.add_parser("check", help="validate a config file as serve would")
    check.add_argument("file")
    config.set_defaults(run=_config)
    inspect = sub.add_parser("inspect", help="say what a checkpoint can do, before anything loads")
    inspect.add_argument("model", metavar="PATH_OR_REPO", help="checkpoint directory, .gguf, or hub repo id")
    inspect.add_argument("--target", metavar="PATH", help="the target model a drafter will pair with")
    inspect.add_argument("--json", action="store_true", help="print the report as JSON")
    inspect.set_defaults(run=_inspect)
    demo = sub.add_parser("demo-model", help="train a demo model with a real MTP head (MLX)")
    training_args.add_demo_model_arguments(demo)
    demo.set_defaults(run=_demo_model)
    drafter = sub.add_parser("demo-drafter", help="train a DFlash block drafter for the demo model (MLX)")
    training_args.add_demo_drafter_arguments(drafter)
    drafter.set_defaults(run=_demo_drafter)
    tune = sub.add_parser("tune", help="measure this machine's costs for a model (the policy uses them)")
    tune.add_argument("model", help="model directory or builtin:demo")
    tune.add_argument("--drafter", help="a DFlash/DSpark drafter to time too (dir or builtin:demo-dflash)")
    tune.add_argument("--reps", type=int, default=5, help="timed repetitions per shape")
    tune.set_defaults(run=_tune)
    llama = sub.add_parser("install-llama-server", help="build llama.cpp's llama-server")
    llama.add_argument("--force", action="store_true", help="rebuild even if already installed")
    llama.add_argument("--jobs", type=int, help="parallel compile jobs (default: all CPUs)")
    llama.set_defaults(run=_install_llama_server)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
