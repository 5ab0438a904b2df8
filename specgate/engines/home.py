"""SPECGATE_HOME: where specgate keeps everything it writes.

The one module that reads the variable, and the one that names the paths
under it ($SPECGATE_HOME, else ~/.specgate):

    models/              builtin models made on first use (the demo as GGUF),
                         and where `specgate demo-model` / `demo-drafter` train to
    keys                 the API keys (gateway/access/keys.py), unless `auth.keys_file`
    thinking.key         the secret that signs Anthropic thinking blocks (gateway/api/thinking.py)
    llama.cpp/           llama-server as `specgate install-llama-server` builds it:
                         <tag>/bin/llama-server, src/, build/<tag>/
    logs/                llama-server's build log and each server's own
    kernels/<machine>/   the kernel guard's verdicts, one file per op (kernels/guard.py)
    mlx-ptx/<mlx version>/  MLX's compiled CUDA kernels (MLX_PTX_CACHE_DIR, unless
                         set), so a restart does not compile them again
    tune/<machine>/      `specgate tune` results per checkpoint digest (kernels/tune.py
                         lays them out under the home it is given)
    prefix-cache/<model>/  the prefix cache's disk tier, per model content
                         (engines/cache/prefix_disk.py)
    imports/<sha256>/    GGUF files imported as MLX checkpoints, by content, and
                         index.json (their digests by path, size, mtime)
                         (engines/checkpoints/gguf_import/)
    peers/               the tests' venvs of other implementations (tests/peers/)
    launch/              what `specgate launch` keeps: each agent's key (keys/<agent>),
                         the files an agent reads (<agent>/), a server it started (serve.log)

Each function takes the home to use, for callers that keep their own (tests,
bench --home); by default the one the environment names, read at each call
(tests set it after import). kernels/ sits below the engines and never reads
this: the engines hand it its directory (engines/kernel_wiring.py).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def specgate_home() -> Path:
    """Where specgate keeps everything it writes ($SPECGATE_HOME, ~/.specgate)."""
    return Path(os.environ.get("SPECGATE_HOME") or Path.home() / ".specgate").expanduser()


def models_dir(home: Path | None = None) -> Path:
    """Models specgate makes: the builtins built on first use, the trainers' output."""
    return (home or specgate_home()) / "models"


def keys_file(home: Path | None = None) -> Path:
    """The API keys file when the config names none."""
    return (home or specgate_home()) / "keys"


def thinking_key_file(home: Path | None = None) -> Path:
    """The secret the server signs its thinking blocks with."""
    return (home or specgate_home()) / "thinking.key"


def llama_cpp_dir(home: Path | None = None) -> Path:
    """specgate's own llama.cpp: sources, build tree and the installed llama-server."""
    return (home or specgate_home()) / "llama.cpp"


def logs_dir(home: Path | None = None) -> Path:
    """Logs of what specgate builds and runs (llama-server's build, each server)."""
    return (home or specgate_home()) / "logs"


def launch_dir(home: Path | None = None) -> Path:
    """What `specgate launch` writes for the coding agents it starts."""
    return (home or specgate_home()) / "launch"


def kernel_cache_dir(home: Path | None = None) -> Path:
    """The kernel guard's verdicts (kernels/guard.py adds <machine>/<op>.json)."""
    return (home or specgate_home()) / "kernels"


def mlx_kernel_cache_dir(mlx_version: str, home: Path | None = None) -> Path:
    """Where MLX's CUDA backend keeps the kernels it compiles at first use."""
    return (home or specgate_home()) / "mlx-ptx" / mlx_version


def use_mlx_kernel_cache(mlx_version: str) -> None:
    """Point MLX's CUDA kernel cache here, unless the environment names one.
    MLX compiles every kernel it first meets with NVRTC (tens of seconds for
    a 4-bit model's) and keeps them in MLX_PTX_CACHE_DIR, by default under
    the system's temp directory: gone at a reboot where that is a tmpfs,
    and unwritable for a service whose user did not create it. MLX reads
    the variable at its first compile, so this runs before a model loads."""
    if not os.environ.get("MLX_PTX_CACHE_DIR"):
        os.environ["MLX_PTX_CACHE_DIR"] = str(mlx_kernel_cache_dir(mlx_version))


def mlx_ptx_dir(mlx_version: str) -> Path:
    """The directory MLX's CUDA backend reads built kernels from in this
    process: MLX_PTX_CACHE_DIR, else MLX's own default
    (mlx/backend/cuda/jit_module.cpp: <temp dir>/mlx/<version>/ptx)."""
    named = os.environ.get("MLX_PTX_CACHE_DIR")
    return Path(named) if named else Path(tempfile.gettempdir()) / "mlx" / mlx_version / "ptx"


def prefix_cache_dir(home: Path | None = None) -> Path:
    """The prefix cache's disk tier (engines/cache/prefix_disk.py adds <model digest>/)."""
    return (home or specgate_home()) / "prefix-cache"


def peers_dir(home: Path | None = None) -> Path:
    """Environments of the peer implementations the tests compare against."""
    return (home or specgate_home()) / "peers"


def imports_dir(home: Path | None = None) -> Path:
    """GGUF files imported for the MLX engines (engines/checkpoints/gguf_import/ adds <sha256>/)."""
    return (home or specgate_home()) / "imports"
