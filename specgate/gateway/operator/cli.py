"""The `specgate` command.

Every subcommand imports what it needs when it runs: `specgate --help` and
`specgate X --help` must not pay for MLX, mlx-lm or transformers (seconds).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import socket

    from specgate.gateway.config import Config

# `serve` exits with this when it cannot start serving: a refused bind, an
# address taken, a failed startup (uvicorn's own STARTUP_FAILURE code).
EXIT_CANNOT_LISTEN = 3


def _unsafe_bind(config: Config) -> str | None:
    """Why serving on this address without keys is refused, or None if fine.
    Checked before anything binds or loads; KeyFileError for a bad keys file."""
    from specgate.gateway.access.auth import is_loopback
    from specgate.gateway.access.keys import read_keys

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

    from specgate.gateway.config import default_config, load_config

    if args.keys_file:
        return Path(args.keys_file).expanduser()
    config = load_config(args.config) if args.config else default_config()
    return config.auth.keys_path


def _keys(args: argparse.Namespace) -> int:
    from specgate.gateway.access.keys import KeyFileError, add_key, read_keys, revoke_key
    from specgate.gateway.config import ConfigError

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
    from specgate.gateway.config import ConfigError, default_config, load_config

    try:
        config = load_config(args.config) if args.config else default_config()
    except ConfigError as e:
        print(f"specgate: bad config\n{e}", file=sys.stderr)
        return 2
    if args.host:
        config.server.host = args.host
    if args.port is not None:
        config.server.port = args.port
    if args.log_format:
        config.server.log_format = args.log_format
    from specgate.gateway.cluster import distributed
    from specgate.gateway.serving import ranks

    if (spread := ranks.distributed_model(config)) is not None:
        if not distributed.launched():
            print(f"specgate: model '{spread.id}' is distributed: start specgate on every "
                  f"machine at once with\n  {distributed.launch_command(spread, args.config)}",
                  file=sys.stderr)  # fmt: skip
            return 2
        if ranks.rank(config) != 0:  # serves no HTTP: follows rank 0's steps
            _logging(config, None, rank=ranks.rank(config))
            return distributed.follow(config)
        distributed.end_drained_with_success()
    from specgate.gateway.access.keys import KeyFileError

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
    overrides = {k: v for k, v in (("host", args.host), ("port", args.port),
                                   ("log_format", args.log_format)) if v is not None}  # fmt: skip
    try:
        return _run_server(config, sockets, args.config, overrides,
                           Path(args.log_file).expanduser() if args.log_file else None)  # fmt: skip
    finally:
        for sock in sockets:
            sock.close()


LOG_FILE_BYTES = 10 << 20  # --log-file: rotated at this size,
LOG_FILES_KEPT = 5  # keeping this many old ones


def _logging(config: Config, log_file: Path | None, rank: int | None = None) -> None:
    """The root logger's one handler: stderr, or `log_file` rotated; each
    line text, or JSON (server.log_format). uvicorn's loggers write through
    it (gateway/server.py), and so does the access log."""
    import logging
    import os

    from specgate.gateway.access.access_log import JsonFormatter

    # transformers (imported after this by the app: tokenizers, grammars)
    # warns at import that PyTorch was not found, which specgate never uses:
    # advice to its own users, printed on stderr (a service's output) and,
    # where CI is set, into this log. Its own switch, set before the import;
    # a value the user exported stays.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    if log_file is not None:  # a service: one rotated file (gateway/operator/service.py)
        from logging.handlers import RotatingFileHandler

        log_file.parent.mkdir(parents=True, exist_ok=True)
        handler = RotatingFileHandler(log_file, maxBytes=LOG_FILE_BYTES, backupCount=LOG_FILES_KEPT)
    else:
        handler = logging.StreamHandler()
    if config.server.log_format == "json":
        handler.setFormatter(JsonFormatter({} if rank is None else {"rank": rank}))
    else:
        prefix = "" if rank is None else f"rank {rank} "
        handler.setFormatter(logging.Formatter(f"%(asctime)s {prefix}%(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=config.server.log_level.upper(), handlers=[handler])
    # httpx logs every call specgate makes to its llama-servers at INFO.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.root.level))


def _run_server(config: Config, sockets: list[socket.socket], config_path: str | None = None,
                overrides: dict | None = None, log_file: Path | None = None) -> int:  # fmt: skip
    import logging

    _logging(config, log_file)  # first: what the app's imports log goes where it should
    from specgate.gateway.access.keys import KeyFileError
    from specgate.gateway.app import create_app
    from specgate.gateway.server import make_server

    try:
        app = create_app(config, config_path, overrides)
    except KeyFileError as e:
        print(f"specgate: {e}", file=sys.stderr)
        return 2
    # Bounded headers, a graceful drain (gateway/server.py); uvicorn's own
    # loggers write where specgate's do.
    server = make_server(app, config)
    # Given sockets, uvicorn says nothing about where it listens.
    for sock in sockets:
        host, port = sock.getsockname()[:2]
        logging.getLogger("specgate.gateway.operator.cli").info(
            "listening on http://%s:%d", f"[{host}]" if ":" in host else host, port)
    try:
        server.run(sockets=sockets)
    finally:
        _end_now_if_a_worker_is_stuck()
    # As uvicorn.run: an app whose startup failed never started serving.
    return 0 if server.started else EXIT_CANNOT_LISTEN


def _end_now_if_a_worker_is_stuck() -> None:
    """A worker thread that did not stop (engines/worker.py's ABANDONED)
    would hang the interpreter's exit: end the process here, status 1."""
    import logging
    import os

    worker = sys.modules.get("specgate.engines.worker")  # (not imported: no MLX engine ever ran)
    stuck = [t.name for t in worker.ABANDONED if t.is_alive()] if worker else []
    if stuck:
        logging.getLogger("specgate.gateway.operator.cli").error("exiting without %s, which did not stop",
                                               ", ".join(stuck))  # fmt: skip
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def _inspect(args: argparse.Namespace) -> int:
    from specgate.engines.checkpoints.inspect import run_cli
    from specgate.gateway.serving.builtins import builtin_path

    return run_cli(args.model, args.target, args.json, builtin=builtin_path)


def _pull(args: argparse.Namespace) -> int:
    from specgate.gateway.operator.pull import run_cli

    return run_cli(args)


def _launch(args: argparse.Namespace) -> int:
    from specgate.gateway.operator.launch import run_cli

    return run_cli(args)


def _demo_model(args: argparse.Namespace) -> int:
    from specgate.builders.demo_training import run_cli

    return run_cli(args)


def _demo_drafter(args: argparse.Namespace) -> int:
    from specgate.builders.dflash_training import run_cli

    return run_cli(args)


def _install_llama_server(args: argparse.Namespace) -> int:
    from specgate.engines.llamacpp.install import run_cli

    return run_cli(force=args.force, jobs=args.jobs)


def _tune(args) -> int:
    from specgate.engines.checkpoints.builtin import UnknownBuiltin
    from specgate.engines.mlx_load import CheckpointLoadError
    from specgate.gateway.serving.tuning import run_cli

    try:
        return run_cli(args)
    except (UnknownBuiltin, CheckpointLoadError) as e:  # what was named is not a model here
        print(f"specgate tune: {e}", file=sys.stderr)
        return 2


def _config(args: argparse.Namespace) -> int:
    import json

    from specgate.gateway.config import ConfigError, json_schema, load_config

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


def _admin(args: argparse.Namespace) -> int:
    """models / ps / load / unload / pin / unpin / ttl / reload: the admin
    API of a running server."""
    import os

    import httpx

    url = args.url.rstrip("/")
    key = args.key or os.environ.get("SPECGATE_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        if args.command in ("models", "ps"):
            r = httpx.get(f"{url}/admin/models", headers=headers, timeout=10)
        elif args.command == "reload":
            r = httpx.post(f"{url}/admin/reload", headers=headers, timeout=60)
        elif args.command == "ttl":
            r = httpx.post(f"{url}/admin/models/{args.model}/idle_ttl", headers=headers, timeout=10,
                           json={"idle_ttl_s": args.seconds})  # fmt: skip
        else:  # a load waits for the model: minutes for a big one
            r = httpx.post(f"{url}/admin/models/{args.model}/{args.command}", headers=headers,
                           timeout=httpx.Timeout(10, read=None if args.command == "load" else 120))  # fmt: skip
    except httpx.HTTPError as e:
        print(f"specgate {args.command}: cannot reach {url}: {e}", file=sys.stderr)
        return 1
    if r.status_code != 200:
        try:
            why = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            why = r.text[:200]
        print(f"specgate {args.command}: {r.status_code}: {why}", file=sys.stderr)
        return 1
    body = r.json()
    if args.command == "reload":
        print(f"keys: {body['keys']}")
        for what, ids in body.get("models", {}).items():
            if ids and what != "unchanged":
                print(f"{what}: {', '.join(ids)}")
        if body.get("restart_needed"):
            print(f"changed, applied at the next restart: {', '.join(body['restart_needed'])}")
        return 0
    if args.command in ("load", "unload"):
        print(f"{body['id']}: {body['status']}")
        return 0
    if args.command in ("pin", "unpin", "ttl"):  # the model's status, residency changed
        ttl = body["idle_ttl_s"]
        print(f"{body['id']}: {'pinned' if body['pin'] else 'not pinned'}, "
              f"{f'unloads after {ttl:g} s idle' if ttl else 'no idle unload'} "
              "(until a restart: the config file is not changed)")
        return 0
    rows = [m for m in body["models"] if args.command == "models" or m["state"] != "unloaded"]
    print(_model_table(rows))
    gib = 1 << 30
    used = sum(sum(m["memory"].values()) for m in body["models"])
    print(f"\nmemory: {used / gib:.2f} GiB of {body['models_budget'] / gib:.2f} GiB for models "
          f"(server.memory_budget {body['memory_budget'] / gib:.2f} GiB; "
          f"prefix cache {body['prefix_cache_budget'] / gib:.2f} GiB)")  # fmt: skip
    return 0


def _ttl_seconds(text: str) -> float | None:
    if text.lower() in ("none", "off"):
        return None
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0.0
    if not 0 < seconds < float("inf"):
        raise argparse.ArgumentTypeError('seconds above 0, or "none"')
    return seconds


def _model_table(models: list[dict]) -> str:
    head = ("MODEL", "STATE", "MEMORY", "RESIDENT", "ENGINES", "IN FLIGHT", "IDLE", "POLICY")
    rows = [head]
    for m in models:
        policy = "pinned" if m["pin"] else (f"ttl {m['idle_ttl_s']:g}s" if m["idle_ttl_s"] else "-")
        rss = m.get("resident")
        rows.append((m["id"], m["state"], _memory_cell(m["memory"], m.get("kv_bits")),
                     _bytes(rss) if rss else "-",
                     ",".join(m["engines"]) + _task_note(m.get("task")), str(m["in_flight"]),
                     f"{m['idle_s']:g}s",
                     f"{m['load']}, {policy}"))  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    errors = [f"  {m['id']}: {m['error']}" for m in models if m["error"]]
    notes = [f"  {m['id']}: {n}" for m in models for n in m.get("notes") or []]
    return "\n".join(lines + (["", "errors:", *errors] if errors else [])
                     + (["", "notes:", *notes] if notes else []))  # fmt: skip


_MEMORY_KINDS = {"weights": "weights", "drafter": "drafter", "kv_reserve": "KV"}


def _bytes(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.0f} MiB"


def _memory_cell(memory: dict, kv_bits: int | None = None) -> str:
    """Its total and, apart, each kind: `0.27 GiB (weights 92 MiB, KV 180 MiB)`;
    a quantized KV cache says its bits (`KV 4-bit 50 MiB`)."""
    total = sum(memory.values())
    if not total:
        return "-"
    kinds = _MEMORY_KINDS | ({"kv_reserve": f"KV {kv_bits}-bit"} if kv_bits else {})
    parts = [f"{kinds.get(k, k)} {_bytes(n)}" for k, n in memory.items() if n]
    return f"{_bytes(total)} ({', '.join(parts)})"


def _task_note(task: str | None) -> str:
    """` (embed)`, ` (rerank)`: a model that does not generate says what it serves."""
    return f" ({task})" if task and task != "generate" else ""


def _service(args: argparse.Namespace) -> int:
    import grp
    import os
    import shlex

    from specgate.engines.home import specgate_home
    from specgate.gateway.config import ConfigError, load_config
    from specgate.gateway.operator import service

    system = service.current_system()
    scope = "system" if args.system else "user"
    account = service.service_account(scope)
    # A system service runs as `account`: its home, not root's (sudo's $HOME).
    home = (specgate_home() if scope == "user" or os.environ.get("SPECGATE_HOME")
            else Path(account.pw_dir) / ".specgate").resolve()  # fmt: skip
    if args.action == "status":
        return _service_status(service, system, scope, home)
    if args.action == "uninstall":
        try:
            service.check_root(system, scope, ["service", "uninstall", "--system"])
        except service.ServiceError as e:
            print(e, file=sys.stderr)
            return 1
        removed = service.uninstall(system, scope, stop=not args.no_stop)
        if removed is None:
            print(f"no service installed ({service.service_path(system, scope)})")
            return 0
        path, argv = removed
        config, log_file = service.option(argv, "--config"), service.option(argv, "--log-file")
        kept = f" ({config}, {Path(log_file).parent})" if config and log_file else ""
        print(f"removed {path}; its config and logs{kept} are left in place")
        return 0
    config = Path(args.config).expanduser().resolve() if args.config else home / "specgate.yaml"
    if args.config and not config.exists():
        print(f"specgate service: {config}: no such file", file=sys.stderr)
        return 2
    made = service.Made()
    try:
        service.preflight(system, scope, not args.no_start, ["--config", str(config)] if args.config else [])
        wrote_config = not config.exists()
        if wrote_config:
            made.mkdir(config.parent)
            made.new_file(config)
            _write_starter_config(config)
        try:
            load_config(config)  # a service that cannot start would only restart forever
        except ConfigError as e:
            print(f"specgate service: bad config, nothing installed\n{e}", file=sys.stderr)
            made.undo()
            return 2
        spec = service.ServiceSpec(service.this_specgate(), config, home, Path.cwd(),
                                   *((account.pw_name, grp.getgrgid(account.pw_gid).gr_name,
                                      Path(account.pw_dir)) if scope == "system" else ()))  # fmt: skip
        path, commands = service.install(spec, system, scope, not args.no_start, made)
    except (service.ServiceError, OSError) as e:
        made.undo()
        print(e if isinstance(e, service.ServiceError) else f"specgate service: {e}; nothing installed",
              file=sys.stderr)  # fmt: skip
        return 1
    if wrote_config:
        print(f"wrote {config} (the demo model; edit it, then `specgate reload`)")
    print(f"wrote {path}; logs in {spec.log_file}")
    if args.no_start:
        print("start it with:\n" + "\n".join("  " + shlex.join(c) for c in commands[-1 if system == "darwin" else 0:]))
    else:
        print(f"started; it starts again at {'boot' if scope == 'system' else 'login'} and after any exit")
    if system == "linux" and scope == "user" and service.lingering_off(account.pw_name):
        print(f"note: a user service stops when you log out; to keep it running: "
              f"sudo loginctl enable-linger {account.pw_name}")  # fmt: skip
    return 0


def _service_status(service, system: str, scope: str, home: Path) -> int:
    """Installed or not, the service manager's state, and where it logs;
    0 when it runs (as `systemctl is-active`), 3 when not."""
    path = service.service_path(system, scope)
    argv = service.installed_argv(path, system) if path.exists() else []
    print(f"installed: {path}" if path.exists() else f"not installed (no {path})")
    state = service.state(system, scope)
    print(f"state: {state}")
    log_file = Path(service.option(argv, "--log-file") or home / "logs" / "specgate.log")
    if system == "darwin":
        before = f"{log_file.parent / 'launchd.out.log'}, {log_file.parent / 'launchd.err.log'}"
    else:
        before = f"journalctl {'--user ' if scope == 'user' else ''}-u {service.UNIT}"
    print(f"logs: {log_file} (what it prints before logging starts: {before})")
    return 0 if state in ("active", "running") else 3


def _write_starter_config(path: Path) -> None:
    import yaml

    from specgate.gateway.config import default_config

    demo = default_config().models[0]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({"models": [{"id": demo.id, "path": demo.path,
                                                "engines": list(demo.engines),
                                                "reply_stop": list(demo.reply_stop)}]}))  # fmt: skip


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("specgate-llm")  # the distribution; `specgate` on PyPI is another project
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


class _VersionAction(argparse.Action):
    """--version, reading the installed package's metadata only when asked."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"specgate {_version()}")
        parser.exit()


class _Subcommand(argparse.ArgumentParser):
    """A subcommand's parser that can add its options only when it is parsed.

    The trainers' options live with the trainers, in builders/, which
    `specgate serve` and the other commands must never import; `add_options`
    runs when `demo-model` or `demo-drafter` is the command (or its --help).
    """

    def __init__(self, *args, add_options=None, **kwargs):
        super().__init__(*args, **kwargs)
        self._add_options = add_options

    def parse_known_args(self, args=None, namespace=None):
        if self._add_options is not None:
            add, self._add_options = self._add_options, None
            add(self)
        return super().parse_known_args(args, namespace)


def _trainer_options(which: str):
    def add(parser: argparse.ArgumentParser) -> None:
        from specgate.builders import training_args

        getattr(training_args, f"add_{which}_arguments")(parser)
    return add


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="specgate", description="An OpenAI/Anthropic-compatible LLM gateway over "
        "speculative-decoding engines (MLX, llama.cpp).")
    parser.add_argument("--version", action=_VersionAction, help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Subcommand)
    serve = sub.add_parser("serve", help="serve the OpenAI-compatible API")
    serve.add_argument("--config", help="YAML config (default: the embedded demo model)")
    serve.add_argument("--host", help="bind address (overrides the config)")
    serve.add_argument("--port", type=int, help="port (overrides the config)")
    serve.add_argument("--log-file", help="log here, rotated at 10 MiB (5 kept), not to stderr")
    serve.add_argument("--log-format", choices=["text", "json"],
                       help="json: every log line a JSON object (overrides server.log_format)")
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
    server = argparse.ArgumentParser(add_help=False)
    server.add_argument("--url", default="http://127.0.0.1:8000", help="the running server")
    server.add_argument("--key", help="an admin API key (default: $SPECGATE_API_KEY)")
    sub.add_parser("models", parents=[server], help="a running server's models: state, memory, "
                   "engines, last use").set_defaults(run=_admin)
    sub.add_parser("ps", parents=[server], help="the models loaded now").set_defaults(run=_admin)
    sub.add_parser("reload", parents=[server], help="re-read the config and keys files "
                   "(as SIGHUP)").set_defaults(run=_admin)
    for verb, what in (("load", "load a model now"), ("unload", "unload a model (a request loads it again)"),
                       ("pin", "keep a model loaded (until a restart; the config is not changed)"),
                       ("unpin", "let a model be unloaded for room or when idle (until a restart)"),
                       ("ttl", "unload a model after SECONDS without requests (until a restart)")):
        p = sub.add_parser(verb, parents=[server], help=what)
        p.add_argument("model")
        if verb == "ttl":
            p.add_argument("seconds", type=_ttl_seconds, help='seconds above 0, or "none": stay loaded')
        p.set_defaults(run=_admin)
    svc = sub.add_parser("service", help="run specgate as a service (launchd, systemd): per user, "
                         "or with --system at boot as the user who ran sudo")
    svc_actions = svc.add_subparsers(dest="action", required=True)
    svc_install = svc_actions.add_parser("install", help="write the service file and start it")
    svc_install.add_argument("--config", help="the YAML it serves (default: $SPECGATE_HOME/specgate.yaml, "
                             "written with the demo model if missing)")
    svc_install.add_argument("--no-start", action="store_true", help="write the file only")
    svc_uninstall = svc_actions.add_parser("uninstall", help="stop the service and remove its file "
                                           "(the config and logs stay)")
    svc_uninstall.add_argument("--no-stop", action="store_true", help="remove the file only")
    svc_status = svc_actions.add_parser("status", help="installed or not, its state, where it logs "
                                        "(exit status 3 when not running)")
    for p in (svc_install, svc_uninstall, svc_status):
        scope = p.add_mutually_exclusive_group()
        scope.add_argument("--user", dest="system", action="store_false", default=False, help="a per-user service "
                           "(a LaunchAgent, a systemd user unit): the default")
        scope.add_argument("--system", action="store_true", help="a LaunchDaemon or system unit, "
                           "started at boot, run as you (SUDO_USER); needs root")
    svc.set_defaults(run=_service)
    from specgate.gateway.operator.launch import AGENTS  # (the standard library only)

    launch = sub.add_parser(
        "launch", help="run a coding agent against this machine's specgate (starting one if none "
        "runs), configured for it", description="Run a coding agent against this machine's "
        "specgate: the running one, else one started in the background (left running). The "
        "agent gets its own configuration (base URL, a key, the model and its context window) "
        "through its environment and command line; your own agent settings are left alone.",
        epilog="Arguments after `--` go to the agent: specgate launch claude -- -p 'hi'")
    launch.add_argument("agent", choices=list(AGENTS), help="the agent to run")
    launch.add_argument("--model", help="the model it uses (default: the server's first)")
    launch.add_argument("--config", help="the YAML a server started here serves, and whose "
                        "host, port and keys file say where to look (default: the embedded demo)")
    launch.add_argument("--url", help="the server (default: the config's host and port)")
    launch.add_argument("--key", help="an API key to give the agent (default: none on a server "
                        "without keys, else one launch makes and keeps per agent)")
    launch.add_argument("--print-config", action="store_true",
                        help="print the settings as shell lines to paste, and run nothing")
    launch.set_defaults(run=_launch)
    inspect = sub.add_parser("inspect", help="say what a checkpoint can do, before anything loads")
    inspect.add_argument("model", metavar="PATH_OR_REPO", help="checkpoint directory, .gguf, hub repo id, ollama:NAME, lmstudio:ORG/REPO")
    inspect.add_argument("--target", metavar="PATH", help="the target model a drafter will pair with")
    inspect.add_argument("--json", action="store_true", help="print the report as JSON")
    inspect.set_defaults(run=_inspect)
    demo = sub.add_parser("demo-model", help="train a demo model with a real MTP head (MLX)",
                          add_options=_trainer_options("demo_model"))
    demo.set_defaults(run=_demo_model)
    drafter = sub.add_parser("demo-drafter", help="train a DFlash block drafter for the demo model (MLX)",
                             add_options=_trainer_options("demo_drafter"))
    drafter.set_defaults(run=_demo_drafter)
    tune = sub.add_parser("tune", help="measure this machine's costs for a model (the policy uses them)")
    tune.add_argument("model", help="model directory or builtin:demo")
    tune.add_argument("--drafter", help="a DFlash/DSpark drafter to time too (dir or builtin:demo-dflash)")
    tune.add_argument("--reps", type=int, default=5, help="timed repetitions per shape")
    tune.set_defaults(run=_tune)
    pull = sub.add_parser("pull", help="download a model from the Hugging Face hub (or HF_ENDPOINT) "
                          "into its cache", description="Download a model into the Hugging Face "
                          "cache, resuming what an earlier run left; HF_ENDPOINT (a mirror) and "
                          "HF_TOKEN are honoured.")
    pull.add_argument("repo", metavar="REPO[@REVISION][:QUANT]", help="a hub repo id; :QUANT picks "
                      "one GGUF file of a GGUF repo (org/name-GGUF:Q4_K_M)")
    pull.add_argument("--include", action="append", metavar="PATTERN", help="download only files "
                      "matching (repeatable; replaces the default choice of files specgate can serve)")
    pull.add_argument("--exclude", action="append", metavar="PATTERN", help="also skip files matching "
                      "(repeatable)")
    pull.set_defaults(run=_pull)
    llama = sub.add_parser("install-llama-server", help="build llama.cpp's llama-server")
    llama.add_argument("--force", action="store_true", help="rebuild even if already installed")
    llama.add_argument("--jobs", type=int, help="parallel compile jobs (default: all CPUs)")
    llama.set_defaults(run=_install_llama_server)
    argv = sys.argv[1:] if argv is None else list(argv)
    # `specgate launch AGENT [options] -- AGENT_ARGS`: what follows `--` is
    # the agent's, split off here (argparse would give it a positional's
    # place, or take its options for launch's).
    agent_args = []
    if argv[:1] == ["launch"] and "--" in argv:
        cut = argv.index("--")
        argv, agent_args = argv[:cut], argv[cut + 1 :]
    args = parser.parse_args(argv)
    args.agent_args = agent_args
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
