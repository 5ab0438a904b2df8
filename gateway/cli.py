"""The `specgate` command."""

from __future__ import annotations

import argparse
import logging
import sys

from gateway.config import ConfigError, default_config, load_config


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from gateway.app import create_app

    try:
        config = load_config(args.config) if args.config else default_config()
    except ConfigError as e:
        print(f"specgate: bad config\n{e}", file=sys.stderr)
        return 2
    if args.host:
        config.server.host = args.host
    if args.port is not None:
        config.server.port = args.port
    logging.basicConfig(
        level=config.server.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # httpx logs every call specgate makes to its llama-servers at INFO.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.root.level))
    uvicorn.run(
        create_app(config),
        host=config.server.host,
        port=config.server.port,
        log_level=config.server.log_level,
        timeout_graceful_shutdown=5,
    )
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from engines.checkpoints.inspect import run_cli

    return run_cli(args.model, args.target, args.json)


def _demo_model(args: argparse.Namespace) -> int:
    from engines.checkpoints.demo_training import run_cli

    return run_cli(args)


def _demo_drafter(args: argparse.Namespace) -> int:
    from engines.checkpoints.dflash_training import run_cli

    return run_cli(args)


def _install_llama_server(args: argparse.Namespace) -> int:
    from engines.llamacpp.install import run_cli

    return run_cli(force=args.force, jobs=args.jobs)


def _tune(args) -> int:
    from gateway.tuning import run_cli

    return run_cli(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specgate", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve the OpenAI-compatible API")
    serve.add_argument("--config", help="YAML config (default: the embedded demo model)")
    serve.add_argument("--host", help="bind address (overrides the config)")
    serve.add_argument("--port", type=int, help="port (overrides the config)")
    serve.set_defaults(run=_serve)
    inspect = sub.add_parser("inspect", help="say what a checkpoint can do, before anything loads")
    inspect.add_argument("model", metavar="PATH_OR_REPO", help="checkpoint directory, .gguf, or hub repo id")
    inspect.add_argument("--target", metavar="PATH", help="the target model a drafter will pair with")
    inspect.add_argument("--json", action="store_true", help="print the report as JSON")
    inspect.set_defaults(run=_inspect)
    demo = sub.add_parser("demo-model", help="train a demo model with a real MTP head (MLX)")
    from engines.checkpoints.demo_training import add_cli_arguments

    add_cli_arguments(demo)
    demo.set_defaults(run=_demo_model)
    drafter = sub.add_parser("demo-drafter", help="train a DFlash block drafter for the demo model (MLX)")
    from engines.checkpoints import dflash_training

    dflash_training.add_cli_arguments(drafter)
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
