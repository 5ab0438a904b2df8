"""Train the demo model: a small Qwen3.5 hybrid whose MTP head really predicts.

Random weights cannot show acceptance or speed, and no real checkpoint can be
downloaded here, so specgate trains its own: a Qwen3.5-layout trunk
(GatedDeltaNet + gated full attention) and its MTP head, jointly, on Python
standard-library sources (text every machine has), with held-out files kept
for evaluation. The head learns as published: from the trunk's final (normed)
hidden state at position i and the embedding of token i+1, predict token i+2.

Two stages, so the slow one can run on a faster machine:
  prepare  tokenizer + tokenized corpus into a work dir (needs `tokenizers`)
  train    MLX training from the work dir; resumable; writes the HF layout
Everything is deterministic from the seed (and the machine's stdlib).
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

# Settings and CLI options live apart, so `specgate --help` need not import MLX.
from specgate.builders.training_args import SIZES, TrainConfig
from specgate.engines.progress import bar, say

HELDOUT_EVERY = 25  # every 25th stdlib file (sorted) is held out for evaluation


class WorkMismatch(ValueError):
    """The work dir holds another run's corpus or state; the message says what to do."""


# -- corpus ------------------------------------------------------------------------


def stdlib_files() -> tuple[list[Path], list[Path]]:
    """(train, held-out) Python sources of this interpreter's stdlib, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file()
    )
    heldout = files[HELDOUT_EVERY // 2 :: HELDOUT_EVERY]
    held = set(heldout)
    return [f for f in files if f not in held], heldout


def prepare(
    work: Path, size: str = "default", seed: int = 0, log=print, max_files: int | None = None
) -> Path:
    """Tokenizer, config and initial weights (published layout), plus the
    tokenized corpus, into `work` (`max_files` caps the corpus: a quick look,
    the tests); what `work` already holds is kept."""
    from specgate.builders.tiny import build_qwen35_hybrid
    from specgate.builders.tokenizer import DEMO_CHAT_TEMPLATE, write_chat_template

    work.mkdir(parents=True, exist_ok=True)
    init = work / "init"
    if not (init / "config.json").exists():
        log(f"building the initial {size} checkpoint and tokenizer")
        # bfloat16 keeps the work dir small enough to carry to a GPU machine;
        # training itself runs in float32.
        build_qwen35_hybrid(init, seed=seed, max_position_embeddings=32768, dtype="bfloat16",
                            **SIZES[size])
    write_chat_template(init, DEMO_CHAT_TEMPLATE)  # export copies it into the model
    write_corpus(work, init / "tokenizer.json", max_files, log)
    return work


CORPUS_BATCH_FILES = 64  # files tokenized per batch: the tokenize bar moves this often


def write_corpus(work: Path, tokenizer: Path, max_files: int | None, log) -> None:
    """The stdlib corpus (train and held-out files), tokenized by `tokenizer`
    (a tokenizer.json), into work/corpus.npz, unless `work` holds it already
    (from the same files)."""
    from tokenizers import Tokenizer

    from specgate.builders.tokenizer import ENDOFTEXT

    record = work / "corpus.json"
    if (work / "corpus.npz").exists():
        held = json.loads(record.read_text()) if record.exists() else {"max_files": None}
        if held["max_files"] != max_files:
            raise WorkMismatch(f"{work} holds a corpus of {held['max_files'] or 'all'} files, not "
                             f"{max_files or 'all'}; remove it or choose another --work")  # fmt: skip
        return
    tok = Tokenizer.from_file(str(tokenizer))
    eot = tok.token_to_id(ENDOFTEXT)
    train_files, heldout_files = stdlib_files()
    if max_files is not None:
        train_files, heldout_files = train_files[:max_files], heldout_files[: max(1, max_files // 10)]
    arrays = {}
    for name, files in (("train", train_files), ("heldout", heldout_files)):
        ids: list[int] = []
        with bar(f"tokenize {name}", len(files), unit="files") as shown:
            for i in range(0, len(files), CORPUS_BATCH_FILES):
                batch = files[i : i + CORPUS_BATCH_FILES]
                texts = [f.read_text(encoding="utf-8", errors="replace") for f in batch]
                for enc in tok.encode_batch(texts, add_special_tokens=False):
                    ids.extend(enc.ids)
                    ids.append(eot)
                shown.update(len(batch))
        arrays[name] = np.array(ids, dtype=np.uint16)
        log(f"{name} corpus: {len(files)} files, {len(ids):,} tokens")
    np.savez_compressed(work / "corpus.npz", **arrays)
    record.write_text(json.dumps({"max_files": max_files}) + "\n")
    (work / "heldout_files.json").write_text(
        json.dumps([str(f.relative_to(sysconfig.get_paths()["stdlib"])) for f in heldout_files])
    )


# -- model -------------------------------------------------------------------------


class DemoModel(nn.Module):
    """Trunk and MTP head together, so one optimizer trains both."""

    def __init__(self, trunk: nn.Module, head: nn.Module):
        super().__init__()
        self.trunk = trunk
        self.head = head

    def losses(self, tokens: mx.array) -> tuple[mx.array, mx.array]:
        """Mean next-token CE of the trunk and next-next-token CE of the head."""
        text = self.trunk.language_model
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        hidden = text.model(inputs)  # after the final norm: what the head reads
        trunk_ce = nn.losses.cross_entropy(text.lm_head(hidden), targets).mean()
        # Position i: embedding of token i+1 and hidden i -> token i+2.
        out = self.head(text.model.embed_tokens(inputs[:, 1:]), hidden[:, :-1])
        mtp_ce = nn.losses.cross_entropy(text.lm_head(out), targets[:, 1:]).mean()
        return trunk_ce, mtp_ce


def load_demo(path: Path) -> DemoModel:
    """A checkpoint in the published layout, as a trainable float32 model."""
    from mlx_lm.models.qwen3_5 import TextModelArgs
    from mlx_lm.utils import load_model

    from specgate.engines.drafting.mtp.head import MTPHead, head_weights_from_checkpoint

    trunk, config = load_model(path, lazy=False)
    tc = config.get("text_config", config)
    head = MTPHead.qwen35(TextModelArgs.from_dict(tc), tc.get("mtp_num_hidden_layers", 1))
    tensors = mx.load(str(path / "model.safetensors"))
    raw_hf = any(k.endswith("conv1d.weight") and v.shape[-1] != 1 for k, v in tensors.items())
    head.load_weights(list(head_weights_from_checkpoint(tensors, raw_hf=raw_hf).items()))
    model = DemoModel(trunk, head)
    model.set_dtype(mx.float32)
    return model


def export(model: DemoModel, init: Path, out: Path, dtype: str) -> Path:
    """Write `model` in the published Qwen3.5 layout (inverse of mlx-lm's
    sanitize: names, conv1d axis, zero-centred norms), then check that
    mlx-lm loads it back to the same logits."""
    from specgate.engines.drafting.mtp.head import head_weights_to_checkpoint

    norm_suffixes = (".input_layernorm.weight", ".post_attention_layernorm.weight",
                     "model.norm.weight", ".q_norm.weight", ".k_norm.weight")  # fmt: skip
    tensors = {}
    for key, value in tree_flatten(model.trunk.parameters()):
        name = key.replace("language_model.model.", "model.language_model.", 1)
        name = name.replace("language_model.lm_head.", "lm_head.", 1)
        if name.endswith("conv1d.weight"):
            value = value.moveaxis(2, 1)  # mlx [C, K, 1] -> HF [C, 1, K]
        elif value.ndim == 1 and name.endswith(norm_suffixes):
            value = value - 1.0
        tensors[name] = value
    tensors.update(head_weights_to_checkpoint(model.head))
    target = getattr(mx, dtype)
    tensors = {k: (v if k.endswith("A_log") else v.astype(target)) for k, v in tensors.items()}

    out.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json", "special_tokens_map.json"):  # fmt: skip
        if (init / name).exists():
            shutil.copy(init / name, out / name)
    config = json.loads((init / "config.json").read_text())
    config["dtype"] = config["text_config"]["dtype"] = dtype
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "model.safetensors.index.json").unlink(missing_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), tensors, metadata={"format": "mlx"})
    _check_roundtrip(model, out)
    return out


def _check_roundtrip(model: DemoModel, out: Path) -> None:
    reloaded = load_demo(out)
    probe = mx.array([[5, 17, 300, 42, 7, 99, 1000, 3]]) % model.trunk.args.text_config["vocab_size"]
    a = model.trunk(probe).astype(mx.float32)
    b = reloaded.trunk(probe)
    err = mx.abs(a - b).max().item() / (mx.abs(a).max().item() + 1e-6)
    if err > 0.05:  # bfloat16 rounding is ~1e-2 relative; a layout bug is O(1)
        raise RuntimeError(f"exported checkpoint does not reload to the same logits (rel err {err:.3f})")


# -- training ----------------------------------------------------------------------


def _schedule(cfg: TrainConfig):
    warm = optim.linear_schedule(1e-6, cfg.learning_rate, cfg.warmup_steps)
    decay = optim.cosine_decay(cfg.learning_rate, max(1, cfg.steps - cfg.warmup_steps),
                               cfg.learning_rate * 0.05)
    return optim.join_schedules([warm, decay], [cfg.warmup_steps])


def _batch(data: np.ndarray, cfg: TrainConfig, step: int) -> mx.array:
    # Seeded by (seed, step): a resumed run draws exactly the batches it would have.
    rng = np.random.default_rng([cfg.seed, step])
    starts = rng.integers(0, len(data) - cfg.seq_len - 2, size=cfg.batch_size)
    return mx.array(np.stack([data[s : s + cfg.seq_len + 1] for s in starts]).astype(np.int32))


def step_bar(last: int, start: int):
    """The training steps' bar (ETA and rate are tqdm's); the loss goes in its postfix.
    Its first step compiles the step function, so the first estimates run long."""
    return bar("train", last, unit="steps", initial=start)


def show_step(shown, losses: str, tokens_per_step: int) -> None:
    """The step bar's postfix: `losses`, then training tokens a second."""
    rate = shown.format_dict["rate"]  # steps a second, smoothed; None before the second step
    tokens = f", {rate * tokens_per_step / 1e3:.1f}k tok/s" if rate else ""
    shown.set_postfix_str(losses + tokens, refresh=False)


def train(
    work: Path,
    out: Path,
    cfg: TrainConfig,
    log=print,
    *,
    stop_after: float | None = None,
    until_step: int | None = None,
) -> Path | None:
    """Train from `work` (see prepare), resuming from work/state if present,
    and export the result to `out`.

    With `stop_after` (seconds) it saves its state and returns None once that
    much time has passed; calling it again continues where it stopped. With
    `until_step` it exports the model as it is at that step of the schedule
    (the shipped demo model was cut short like this).
    """
    started = time.monotonic()
    last = min(cfg.steps, until_step or cfg.steps)
    init = work / "init"
    data = np.load(work / "corpus.npz")["train"]
    state_dir = work / "state"
    mx.random.seed(cfg.seed)
    model = load_demo(init)
    optimizer = optim.AdamW(learning_rate=_schedule(cfg), weight_decay=cfg.weight_decay)
    start = 0
    if (state_dir / "progress.json").exists():
        saved = json.loads((state_dir / "progress.json").read_text())
        if saved["config"] != asdict(cfg):
            raise WorkMismatch(f"{state_dir} holds a run with other settings; remove it to start over")
        model.load_weights(str(state_dir / "weights.safetensors"))
        optimizer.init(model.trainable_parameters())
        optimizer.state = tree_unflatten(list(mx.load(str(state_dir / "optimizer.safetensors")).items()))
        start = saved["step"]
        log(f"resuming at step {start}")

    state = [model.state, optimizer.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def step_fn(tokens):
        def loss(m):
            trunk_ce, mtp_ce = m.losses(tokens)
            return trunk_ce + cfg.mtp_weight * mtp_ce, (trunk_ce, mtp_ce)

        (_, parts), grads = nn.value_and_grad(model, loss)(model)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        optimizer.update(model, grads)
        return parts

    with step_bar(last, start) as shown:
        for step in range(start + 1, last + 1):
            trunk_ce, mtp_ce = step_fn(_batch(data, cfg, step))
            mx.eval(state, trunk_ce, mtp_ce)
            show_step(shown, f"loss trunk {trunk_ce.item():.3f} mtp {mtp_ce.item():.3f}",
                      cfg.batch_size * cfg.seq_len)  # fmt: skip
            shown.update(1)
            out_of_time = stop_after is not None and time.monotonic() - started > stop_after
            if step % cfg.save_every == 0 or step == last or out_of_time:
                _save_state(model, optimizer, state_dir, step, cfg)
            if out_of_time and step < last:
                log(f"stopping at step {step}; run again to resume")
                return None
    log(f"exporting to {out}")
    return export(model, init, out, cfg.dtype)


def _save_state(model, optimizer, state_dir: Path, step: int, cfg: TrainConfig) -> None:
    tmp = state_dir.with_name(state_dir.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    model.save_weights(str(tmp / "weights.safetensors"))
    mx.save_safetensors(str(tmp / "optimizer.safetensors"), dict(tree_flatten(optimizer.state)))
    (tmp / "progress.json").write_text(json.dumps({"step": step, "config": asdict(cfg)}))
    shutil.rmtree(state_dir, ignore_errors=True)
    tmp.rename(state_dir)


# -- evaluation --------------------------------------------------------------------


@dataclass
class Evaluation:
    tokens: int
    trunk_perplexity: float
    mtp_acceptance: float  # head argmax == trunk's next greedy token


def evaluate(model: DemoModel, tokens: np.ndarray, window: int = 512) -> Evaluation:
    """Teacher-forced over `tokens` in windows: trunk perplexity, and greedy
    MTP acceptance at depth 1 (position i: the head, given hidden i and the
    true token i+1, drafts token i+2; it is accepted when it equals the
    trunk's own greedy prediction after token i+1)."""
    text = model.trunk.language_model
    nll, count, agree, drafts = 0.0, 0, 0, 0
    for s in range(0, len(tokens) - 2, window):
        chunk = mx.array(tokens[s : s + window + 1].astype(np.int32))[None]
        if chunk.shape[1] < 3:
            break
        inputs, targets = chunk[:, :-1], chunk[:, 1:]
        hidden = text.model(inputs)
        logits = text.lm_head(hidden)
        nll += nn.losses.cross_entropy(logits, targets, reduction="sum").item()
        count += targets.size
        out = model.head(text.model.embed_tokens(inputs[:, 1:]), hidden[:, :-1])
        draft = mx.argmax(text.lm_head(out), axis=-1)
        greedy_next = mx.argmax(logits[:, 1:], axis=-1)
        agree += (draft == greedy_next).sum().item()
        drafts += draft.size
    return Evaluation(count, math.exp(nll / max(count, 1)), agree / max(drafts, 1))


def main_log(line: str) -> None:
    say(line, sys.stderr)


def run_cli(args) -> int:
    """`specgate demo-model`: prepare (once), train (resumable), evaluate, export."""
    from specgate.engines.home import models_dir

    out = Path(args.out) if args.out else models_dir() / f"demo-{args.size}"
    work = Path(args.work) if args.work else out.with_name(out.name + ".work")
    cfg = TrainConfig(size=args.size, seed=args.seed, steps=args.steps,
                      batch_size=args.batch_size, seq_len=args.seq_len,
                      learning_rate=args.lr)  # fmt: skip
    try:
        prepare(work, args.size, args.seed, log=main_log, max_files=args.max_files)
        result = train(work, out, cfg, log=main_log, stop_after=args.stop_after,
                       until_step=args.until_step)  # fmt: skip
    except WorkMismatch as e:
        main_log(f"specgate demo-model: {e}")
        return 2
    if result is None:
        main_log("stopped before the end: run the same command again to resume")
        return 3
    if args.eval_tokens:
        held = np.load(work / "corpus.npz")["heldout"][: args.eval_tokens]
        main_log(f"evaluating on {len(held):,} held-out tokens")
        ev = evaluate(load_demo(result), held)
        main_log(f"held-out ({ev.tokens:,} tokens): trunk perplexity {ev.trunk_perplexity:.2f}, "
                 f"MTP acceptance at depth 1 {ev.mtp_acceptance:.3f}")  # fmt: skip
    if args.gguf:
        from specgate.builders.gguf_export import export_gguf

        main_log(f"exporting a GGUF to {args.gguf}")
        export_gguf(result, Path(args.gguf), outtype="f16")
        main_log(f"GGUF with nextn tensors: {args.gguf}")
    print(result)
    return 0
