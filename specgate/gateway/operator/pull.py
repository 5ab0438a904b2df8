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

from specgate.engines.progress import LineBar, interactive, say

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
    from huggingface_hub.utils import are_progress_bars_disabled

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
        say(f"{repo}@{rev}: {len(chosen)} of {len(files)} files")
        # On a terminal huggingface_hub's own bars (HF_HUB_DISABLE_PROGRESS_BARS
        # silences them); elsewhere plain lines.
        lines = not interactive() and not are_progress_bars_disabled()
        snapshot = snapshot_download(repo, revision=rev, allow_patterns=allow, ignore_patterns=ignore,
                                     tqdm_class=_PullLines if lines else None)
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


class _PullLines(LineBar):
    """snapshot_download's bars as plain lines, for logs and pipes: its bar of
    files ("files") and its bar of bytes written ("download"). Its other byte
    bar, of network transfer, counts the same bytes against a guessed total
    (huggingface_hub's _xet_progress_reporting), so it stays quiet."""

    def __init__(self, *args, **kwargs):
        desc = kwargs.get("desc") or ""
        self._quiet = desc.startswith("Downloading bytes")
        files = desc.startswith("Fetching")
        kwargs["desc"], kwargs["unit"] = ("files", "files") if files else ("download", "B")
        kwargs.pop("bar_format", None)  # a bar's layout; a line has its own
        super().__init__(*args, **kwargs)

    def display(self, msg=None, pos=None):
        return False if self._quiet else super().display(msg, pos)

    def set_description(self, desc=None, refresh=True):
        pass  # "Reconstruction complete" and the like: the lines keep their stage's name

    set_description_str = set_description


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
