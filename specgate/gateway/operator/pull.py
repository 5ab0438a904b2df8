"""`specgate pull REPO[@REVISION][:QUANT]`: download a model into the
Hugging Face cache ahead of serving (a store name never downloads at serve).

Everything is huggingface_hub's (snapshot_download): the cache layout,
resuming a file whose connection dropped (within the run: huggingface_hub
2.x discards a failed run's partial file), HF_ENDPOINT mirrors, HF_TOKEN. What is ours:
which files. By default those specgate can serve (safetensors, configs,
tokenizer, GGUF), skipping other frameworks' weights and `original/`
folders; for a GGUF repo `REPO:QUANT` takes only that quantization's file
(or shards), as llama.cpp's `-hf` does. `--include` replaces the default
choice; `--exclude` adds to what is skipped.
"""

from __future__ import annotations

import argparse
import re
import sys
from fnmatch import fnmatch

# Other frameworks' weights and the original (consolidated) checkpoints that
# some repos carry beside the Hugging Face ones.
SKIPPED = ["original/*", "*.pt", "*.pth", "*.ckpt", "*.h5", "*.msgpack", "*.onnx", "*.onnx_data",
           "*.ot", "*.tflite", "*.mlmodel", "onnx/*", "coreml/*", "openvino/*"]
# PyTorch's pickled weights, skipped when the repo has safetensors.
PICKLED = ["*.bin"]
_SPEC = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<rev>[^:\s]+))?(?::(?P<quant>[\w.-]+))?$")


class PullError(Exception):
    """What to tell the user; exit status 1 (2 for a malformed name)."""


def _patterns(files: list[str], repo: str, quant: str | None, include: list[str],
              exclude: list[str]) -> tuple[list[str] | None, list[str]]:
    """(allow, ignore) for snapshot_download over the repo's `files`."""
    from specgate.engines.checkpoints.gguf_pick import SourceError, pick_gguf

    if quant:
        try:
            return pick_gguf([f for f in files if f.lower().endswith(".gguf")], quant, repo, repo), exclude
        except SourceError as e:
            raise PullError(str(e)) from None
    if include:
        return include, exclude
    ignore = SKIPPED + exclude
    if any(f.endswith(".safetensors") for f in files):
        ignore += PICKLED + ["*.gguf"]  # the safetensors are the model
    else:
        ggufs = [f for f in files if f.lower().endswith(".gguf")]
        if ggufs:  # a GGUF repo: one model, never every quantization
            try:
                return pick_gguf(ggufs, None, repo, repo), exclude
            except SourceError as e:
                raise PullError(str(e)) from None
    return None, ignore


def pull(spec: str, include: list[str], exclude: list[str]) -> tuple[str, str]:
    """Download; (the local path to serve, the config `path:` value)."""
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    from specgate.engines.checkpoints.locate import hub_offline

    m = _SPEC.match(spec)
    if not m:
        raise PullError(f"{spec}: expected ORG/NAME, ORG/NAME@REVISION or ORG/NAME:QUANT "
                        "(e.g. bartowski/SmolLM2-135M-Instruct-GGUF:Q4_K_M)")
    if hub_offline():
        raise PullError("HF_HUB_OFFLINE is set: pulling needs the hub (or an HF_ENDPOINT mirror)")
    repo, rev, quant = m["repo"], m["rev"] or "main", m["quant"]
    try:
        files = HfApi().list_repo_files(repo, revision=rev)
        allow, ignore = _patterns(files, repo, quant, include, exclude)
        chosen = [f for f in files if (allow is None or any(fnmatch(f, p) for p in allow))
                  and not any(fnmatch(f, p) for p in ignore)]
        print(f"{repo}@{rev}: {len(chosen)} of {len(files)} files", file=sys.stderr)
        snapshot = snapshot_download(repo, revision=rev, allow_patterns=allow, ignore_patterns=ignore,
                                     tqdm_class=None if sys.stderr.isatty() else _LineProgress)
    except GatedRepoError:
        raise PullError(f"{repo} is gated: accept its terms on the hub, then set HF_TOKEN or "
                        "`hf auth login`") from None
    except RepositoryNotFoundError:
        raise PullError(f"{repo}: no such repo (or it is private: set HF_TOKEN or `hf auth login`)") from None
    except RevisionNotFoundError:
        raise PullError(f"{repo} has no revision {rev}") from None
    except (HfHubHTTPError, OSError) as e:
        # huggingface_hub resumes a dropped connection within the run; a run
        # that gives up keeps the files it finished, not the partial one.
        raise PullError(f"{repo}: download failed: {e} (files already complete are kept; "
                        "run it again for the rest)") from None
    if allow is not None and quant is None and len(allow) and allow[0].lower().endswith(".gguf"):
        quant = _quant_label(allow[0])
    name = f"{repo}:{quant}" if quant else repo
    local = f"{snapshot}/{allow[0]}" if allow and allow[0].lower().endswith(".gguf") else snapshot
    return local, name


def _quant_label(filename: str) -> str | None:
    from specgate.engines.checkpoints.gguf_pick import quant_of

    return quant_of(filename)


class _LineProgress:
    """Progress for logs and pipes: a line per tenth of the bytes, where
    tqdm's bars would fill a log with carriage returns. snapshot_download
    uses any class with tqdm's interface for its aggregate bars (a class
    that is no tqdm subclass gets no `name`/`disable`)."""

    _byte_bar_made = False

    def __init__(self, iterable=None, *, desc: str = "", total: float | None = None,
                 initial: float = 0, unit: str = "it", **_):
        self.iterable, self.desc, self.total, self.n, self.unit = iterable, desc, total, initial, unit
        self.format_dict: dict = {}
        self._said = -1
        # snapshot_download keeps two byte bars (network, disk) that count the
        # same bytes over plain HTTP: the first one speaks.
        self._speaks = unit == "B" and not _LineProgress._byte_bar_made
        _LineProgress._byte_bar_made |= unit == "B"

    def __iter__(self):
        yield from self.iterable or ()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @classmethod
    def get_lock(cls):
        import threading

        return threading.RLock()

    @classmethod
    def set_lock(cls, lock):
        pass

    def update(self, n: float | None = 1) -> None:
        self.n += n or 0
        if self._speaks and self.total:
            tenth = int(10 * self.n / self.total)
            if tenth > self._said:
                self._said = tenth
                print(f"  {self.n / 2**20:,.1f} of {self.total / 2**20:,.1f} MiB "
                      f"({100 * self.n / self.total:.0f}%)", file=sys.stderr, flush=True)

    def refresh(self, *_, **__) -> None:
        pass

    def set_description(self, desc: str = "", *_, **__) -> None:
        self.desc = desc

    set_description_str = set_description

    def set_postfix_str(self, *_, **__) -> None:
        pass

    def close(self) -> None:
        pass


def run_cli(args: argparse.Namespace) -> int:
    try:
        local, name = pull(args.repo, args.include or [], args.exclude or [])
    except PullError as e:
        print(f"specgate pull: {e}", file=sys.stderr)
        return 1
    engines = "llamacpp" if local.lower().endswith(".gguf") else "mlx_plain"
    print(f"downloaded to {local}")
    print("serve it with this entry under `models:` in a config:")
    print(f'  - {{id: {name.split("/")[-1].split(":")[0].lower()}, path: "{name}", engines: [{engines}]}}')
    return 0
