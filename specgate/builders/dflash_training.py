"""Train a DFlash block drafter for a target model (by default the shipped demo).

A random drafter proposes nothing the target accepts, so specgate trains its
own for the demo model: a z-lab-layout DFlash drafter (engines/drafting/dflash/ and dspark/
dflash.py) on the same Python stdlib corpus and held-out split as the demo
model itself (demo_training.py), tokenized with the target's tokenizer.

The objective is DFlash's. For an anchor a in a token window x, the drafter
sees the context (the target's layer outputs for positions < a) and the block
[x_a, mask x (L-1)] at positions a..a+L-1; its output at block position j,
through the target's frozen lm_head, should name token a+j. The label is the
*target's own* greedy prediction of token a+j from the true prefix (its
argmax at position a+j-1), not the corpus token: greedy verification accepts
a draft exactly when it equals the target's argmax, and for j = 1 that label
is the verification rule itself. Position j's loss is weighted
exp(-(j-1)/decay), as the DFlash paper weights early positions more: a miss
at j makes every later position worthless.

One forward trains many anchors of a window: the target runs once over the
window (frozen, no gradient), and the K blocks go along a batch axis, each
at its own RoPE offset, all attending to the window's shared context K/V
through a mask that lets block k see context positions < a_k and its own
block (both ways, as at inference). `block_forward` is that forward, written
on the drafter module's own sublayers; a test checks it against
`DFlashDrafter.__call__`.

Stages, as in demo_training: prepare (tokenize; an initial drafter from
drafters.build_dflash_drafter, so the output has the published config),
train (resumable: the same command continues), evaluate (real greedy DFlash
decoding of held-out prompts with engines/mlx_spec/decoder.py), export
(bfloat16, z-lab layout).
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from specgate.builders.demo_training import (
    WorkMismatch,
    _save_state,
    _schedule,
    main_log,
    show_step,
    step_bar,
    write_corpus,
)
from specgate.builders.training_args import DrafterConfig
from specgate.engines.drafting.dflash.model import DFlashAttention, DFlashDrafter, load_dflash
from specgate.engines.progress import bar
from specgate.engines.targets import Target, target_for

# -- corpus and initial drafter ----------------------------------------------------


def unused_token_id(target: Path) -> int | None:
    """The byte-level token for 0xC0, which no UTF-8 text contains: the mask
    id then never meets a real token (Qwen's drafters use an unused padded
    row for the same reason). None when the target has no such token."""
    path = Path(target) / "tokenizer.json"
    if not path.is_file():
        return None
    vocab = json.loads(path.read_text())["model"]["vocab"]
    return vocab.get("\u00c0")  # GPT-2's byte-to-unicode map sends 0xC0 to U+00C0


def prepare(work: Path, target: Path, cfg: DrafterConfig, log=print,
            max_files: int | None = None) -> Path:  # fmt: skip
    """The stdlib corpus (demo_training's split) tokenized with the target's
    tokenizer, and a random initial drafter in the published layout."""
    from specgate.builders.drafters import build_dflash_drafter

    work.mkdir(parents=True, exist_ok=True)
    write_corpus(work, target / "tokenizer.json", max_files, log)
    if not (work / "init" / "config.json").exists():
        log("building the initial drafter")
        mask = cfg.mask_token_id if cfg.mask_token_id is not None else unused_token_id(target)
        build_dflash_drafter(work / "init", target=target, num_hidden_layers=cfg.num_layers,
                             block_size=cfg.block_size, target_layer_ids=cfg.target_layer_ids,
                             mask_token_id=mask, seed=cfg.seed, dtype="float32")  # fmt: skip
    return work


def load_target(path: Path) -> Target:
    """The target, frozen, as float32 (training precision)."""
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(path), lazy=False)
    model.set_dtype(mx.float32)
    model.freeze()
    return target_for(model)


# -- the training forward ----------------------------------------------------------


def target_view(trunk: Target, tokens: mx.array, layer_ids: list[int]) -> tuple[mx.array, mx.array]:
    """The drafter's context features (B, T, n*H) for `tokens` (B, T), and the
    target's greedy next token at every position (B, T)."""
    forward = trunk.forward(tokens, None, layers=layer_ids)
    features = mx.concatenate([forward.layers[i] for i in layer_ids], axis=-1)
    greedy = mx.argmax(trunk.logits(forward.hidden), axis=-1)
    return mx.stop_gradient(features), greedy


def _block_attention(attn: DFlashAttention, x: mx.array, context: mx.array,
                     anchors: mx.array) -> mx.array:  # fmt: skip
    """DFlashAttention for K blocks per window at once.

    x: (B, K, L, H) the blocks' normed inputs; context: (B, T, H) the fused
    window; anchors: (B, K) block k's first position. Block k's queries see
    context positions < a_k and all of block k, as the inference module's
    unmasked attention over [context so far, block] does.
    """
    B, K, L, _ = x.shape
    T = context.shape[1]
    nh, nkv, hd = attn.n_heads, attn.n_kv, attn.head_dim
    rep = nh // nkv
    offsets = anchors.reshape(-1)  # one RoPE offset per block

    def project(proj, norm, inp, rows, n, offset):
        t = proj(inp).reshape(rows, -1, n, hd)
        t = (norm(t) if norm is not None else t).transpose(0, 2, 1, 3)
        return t if offset is None else attn.rope(t, offset=offset)

    q = project(attn.q_proj, attn.q_norm, x.reshape(B * K, L, -1), B * K, nh, offsets)
    kb = project(attn.k_proj, attn.k_norm, x.reshape(B * K, L, -1), B * K, nkv, offsets)
    vb = project(attn.v_proj, None, x.reshape(B * K, L, -1), B * K, nkv, None)
    kc = project(attn.k_proj, attn.k_norm, context, B, nkv, 0)  # (B, nkv, T, hd)
    vc = project(attn.v_proj, None, context, B, nkv, None)

    # Query head h reads kv head h // rep (grouped-query attention): group the
    # queries as (B, nkv, rep, K, L, hd) so each group meets its K/V.
    q = q.reshape(B, K, nkv, rep, L, hd).transpose(0, 2, 3, 1, 4, 5) * attn.scale
    kb = kb.reshape(B, K, nkv, L, hd).transpose(0, 2, 1, 3, 4)[:, :, None]
    vb = vb.reshape(B, K, nkv, L, hd).transpose(0, 2, 1, 3, 4)[:, :, None]
    s_ctx = q.reshape(B, nkv, rep, K * L, hd) @ kc[:, :, None].swapaxes(-1, -2)
    s_ctx = s_ctx.reshape(B, nkv, rep, K, L, T)
    visible = mx.arange(T) < anchors[..., None]  # (B, K, T)
    s_ctx = mx.where(visible[:, None, None, :, None, :], s_ctx, mx.array(-mx.inf, s_ctx.dtype))
    s_blk = q @ kb.swapaxes(-1, -2)  # (B, nkv, rep, K, L, L)
    p = mx.softmax(mx.concatenate([s_ctx, s_blk], axis=-1), axis=-1, precise=True)
    out = p[..., :T].reshape(B, nkv, rep, K * L, T) @ vc[:, :, None]
    out = out.reshape(B, nkv, rep, K, L, hd) + p[..., T:] @ vb
    return attn.o_proj(out.transpose(0, 3, 4, 1, 2, 5).reshape(B, K, L, nh * hd))


def block_forward(drafter: DFlashDrafter, blocks: mx.array, features: mx.array,
                  anchors: mx.array) -> mx.array:  # fmt: skip
    """The drafter's output (B, K, L, H) for K embedded blocks (B, K, L, H)
    per window, given the window's features (B, T, n*H)."""
    context = drafter.hidden_norm(drafter.fc(features))
    h = blocks
    for layer in drafter.layers:
        h = h + _block_attention(layer.self_attn, layer.input_layernorm(h), context, anchors)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return drafter.norm(h)


def block_inputs(trunk: Target, tokens: mx.array, greedy: mx.array, anchors: mx.array,
                 block_size: int, mask_token_id: int) -> tuple[mx.array, mx.array]:  # fmt: skip
    """Embedded blocks (B, K, L, H) [x_a, mask...] and their labels (B, K, L-1):
    the target's greedy choice for tokens a+1..a+L-1."""
    B, K = anchors.shape
    first = mx.take_along_axis(tokens, anchors, axis=1)[..., None]
    masks = mx.full((B, K, block_size - 1), mask_token_id, dtype=first.dtype)
    blocks = trunk.embed(mx.concatenate([first, masks], axis=-1))
    # greedy[p] is the target's choice for token p+1.
    where = (anchors[..., None] + mx.arange(block_size - 1)).reshape(B, -1)
    labels = mx.take_along_axis(greedy, where, axis=1).reshape(B, K, block_size - 1)
    return blocks, labels


def sample_batch(data: np.ndarray, cfg: DrafterConfig, step: int) -> tuple[mx.array, mx.array]:
    """Windows (B, T) and sorted distinct anchors (B, K), seeded by (seed, step)
    so a resumed run draws what it would have. An anchor a needs context
    (a >= 1) and labels inside the window (a + L - 2 <= T - 1)."""
    rng = np.random.default_rng([cfg.seed, step])
    starts = rng.integers(0, len(data) - cfg.seq_len, size=cfg.batch_size)
    windows = np.stack([data[s : s + cfg.seq_len] for s in starts]).astype(np.int32)
    last = cfg.seq_len - cfg.block_size + 1
    anchors = np.stack([np.sort(rng.choice(np.arange(1, last + 1), cfg.anchors, replace=False))
                        for _ in range(cfg.batch_size)]).astype(np.int32)  # fmt: skip
    return mx.array(windows), mx.array(anchors)


def position_weights(cfg: DrafterConfig) -> mx.array:
    return mx.exp(-mx.arange(cfg.block_size - 1, dtype=mx.float32) / cfg.decay)


def block_loss(drafter: DFlashDrafter, trunk: Target, blocks, labels, features, anchors,
               weights: mx.array) -> tuple[mx.array, mx.array]:  # fmt: skip
    """Weighted mean CE, and which drafts equal their labels (B, K, L-1)."""
    out = block_forward(drafter, blocks, features, anchors)
    logits = trunk.logits(out[:, :, 1:])
    ce = nn.losses.cross_entropy(logits, labels)
    loss = (ce * weights).sum() / (weights.sum() * labels.shape[0] * labels.shape[1])
    return loss, mx.argmax(logits, axis=-1) == labels


def accepted_prefix(hits: mx.array) -> mx.array:
    """Length of the leading run of hits along the last axis."""
    return mx.cumprod(hits.astype(mx.int32), axis=-1).sum(axis=-1)


# -- training ----------------------------------------------------------------------


def load_trainable(path: Path) -> DFlashDrafter:
    drafter = load_dflash(path, dtype=mx.float32)
    drafter.set_dtype(mx.float32)
    return drafter


def train(work: Path, target: Path, out: Path, cfg: DrafterConfig, log=print, *,
          stop_after: float | None = None, until_step: int | None = None,
          log_every: int = 10) -> Path | None:  # fmt: skip
    """Train from `work` (see prepare), resuming from work/state if present,
    and export to `out`. `stop_after` (seconds): save and return None once
    that much time has passed; the same call again continues. `until_step`:
    export the drafter as it is at that step of the schedule.

    The step bar's postfix: weighted loss, how often the first draft equals
    the target's greedy token, and the mean accepted prefix of the block's
    drafts against teacher-forced labels (an estimate of accepted drafts per
    round), over the last `log_every` steps; tokens/s counts window tokens.
    """
    started = time.monotonic()
    last = min(cfg.steps, until_step or cfg.steps)
    data = np.load(work / "corpus.npz")["train"]
    state_dir = work / "state"
    mx.random.seed(cfg.seed)
    trunk = load_target(target)
    drafter = load_trainable(work / "init")
    mask = drafter.args.mask_token_id
    optimizer = optim.AdamW(learning_rate=_schedule(cfg), weight_decay=cfg.weight_decay)
    start = 0
    if (state_dir / "progress.json").exists():
        saved = json.loads((state_dir / "progress.json").read_text())
        if saved["config"] != asdict(cfg):
            raise WorkMismatch(
                f"{state_dir} holds a run with other settings; remove it to start over"
            )
        drafter.load_weights(str(state_dir / "weights.safetensors"))
        optimizer.init(drafter.trainable_parameters())
        optimizer.state = tree_unflatten(
            list(mx.load(str(state_dir / "optimizer.safetensors")).items())
        )
        start = saved["step"]
        log(f"resuming at step {start}")

    weights = position_weights(cfg)
    state = [drafter.state, optimizer.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def step_fn(blocks, labels, features, anchors):
        def loss(d):
            return block_loss(d, trunk, blocks, labels, features, anchors, weights)

        (value, hits), grads = nn.value_and_grad(drafter, loss)(drafter)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        optimizer.update(drafter, grads)
        return value, hits

    window: list[tuple[float, float, float]] = []
    with step_bar(last, start) as shown:
        for step in range(start + 1, last + 1):
            tokens, anchors = sample_batch(data, cfg, step)
            features, greedy = target_view(trunk, tokens, drafter.args.target_layer_ids)
            blocks, labels = block_inputs(trunk, tokens, greedy, anchors, cfg.block_size, mask)
            value, hits = step_fn(blocks, labels, features, anchors)
            mx.eval(state, value, hits)
            window.append((value.item(), hits[..., 0].mean().item(),
                           accepted_prefix(hits).astype(mx.float32).mean().item()))  # fmt: skip
            if len(window) == log_every or step == last or step == start + 1:
                loss, first, tau = np.mean(window, axis=0)
                show_step(shown, f"loss {loss:.3f} draft-1 acc {first:.3f} prefix {tau:.2f}",
                          cfg.batch_size * cfg.seq_len)  # fmt: skip
                window = []
            shown.update(1)
            out_of_time = stop_after is not None and time.monotonic() - started > stop_after
            if step % cfg.save_every == 0 or step == last or out_of_time:
                _save_state(drafter, optimizer, state_dir, step, cfg)
            if out_of_time and step < last:
                log(f"stopping at step {step}; run again to resume")
                return None
    log(f"exporting to {out}")
    return export(drafter, work / "init", out, cfg.dtype)


def export(drafter: DFlashDrafter, init: Path, out: Path, dtype: str) -> Path:
    """The drafter in z-lab's layout (unprefixed names, as the builder writes
    them), with the initial checkpoint's config and tokenizer files."""
    out.mkdir(parents=True, exist_ok=True)
    for f in init.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and not f.name.endswith(".index.json"):
            shutil.copy(f, out / f.name)
    config = json.loads((init / "config.json").read_text())
    config["torch_dtype" if "torch_dtype" in config else "dtype"] = dtype
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    target = getattr(mx, dtype)
    tensors = {k: v.astype(target) for k, v in tree_flatten(drafter.parameters())}
    mx.save_safetensors(str(out / "model.safetensors"), tensors, metadata={"format": "mlx"})
    reloaded = load_dflash(out)  # the engine's own loader must take it, strictly
    if reloaded.args != drafter.args:
        raise RuntimeError("exported drafter reloads with other settings")
    return out


# -- evaluation --------------------------------------------------------------------


@dataclass
class Acceptance:
    block_length: int  # drafts verified per round + 1
    rounds: int
    drafted: int
    accepted: int

    @property
    def rate(self) -> float:
        """Accepted drafts / drafted."""
        return self.accepted / max(self.drafted, 1)

    @property
    def mean_accepted(self) -> float:
        """Accepted drafts per round (the round's own target token not counted)."""
        return self.accepted / max(self.rounds, 1)


def heldout_prompts(tokens: np.ndarray, n: int, length: int, seed: int = 0) -> list[list[int]]:
    """n windows of held-out code, seeded."""
    rng = np.random.default_rng([seed, 1])
    starts = rng.integers(0, len(tokens) - length, size=n)
    return [tokens[s : s + length].astype(int).tolist() for s in starts]


def measure_acceptance(trunk: Target, drafter: DFlashDrafter, prompts: list[list[int]],
                       block_length: int, new_tokens: int,
                       stop_token_ids: frozenset[int] = frozenset(),
                       done=lambda: None) -> Acceptance:  # fmt: skip
    """Greedy DFlash decoding of each prompt with the engine's own decoder,
    verifying `block_length - 1` drafts a round: the acceptance a user sees."""
    from specgate.engines.base import GenerationRequest, Plan, SamplingParams
    from specgate.engines.drafting.dflash.proposer import DFlashProposer
    from specgate.engines.mlx_spec.decoder import SpecDecoder

    depth = block_length - 1
    result = Acceptance(block_length, 0, 0, 0)
    for i, prompt in enumerate(prompts):
        request = GenerationRequest(f"eval-{i}", "eval", prompt, SamplingParams(temperature=0),
                                    new_tokens, Plan("mlx_dflash", "dflash", depth, "spec_on"),
                                    stop_token_ids)  # fmt: skip
        decoder = SpecDecoder(trunk, DFlashProposer(trunk, drafter), request, None, 0, None)
        step = decoder.prefill()
        while step.finish_reason is None:
            step = decoder.round(depth)
            result.rounds += 1
            result.drafted += step.stats.drafted
            result.accepted += step.stats.accepted
        done()
    return result


def evaluate(target: Path, drafter_path: Path, heldout: np.ndarray, *, prompts: int = 16,
             prompt_len: int = 128, new_tokens: int = 64,
             block_lengths: list[int] | None = None) -> list[Acceptance]:  # fmt: skip
    """Held-out acceptance of the drafter at `drafter_path` with the target as
    it is stored (the precision an engine serves it in), per block length."""
    from mlx_lm.utils import load_model

    from specgate.engines.drafting.dflash.model import check_pairing

    model, config = load_model(Path(target))
    trunk = target_for(model)
    drafter = load_dflash(drafter_path)
    check_pairing(drafter, trunk)
    eos = config.get("text_config", config).get("eos_token_id")
    stops = frozenset(eos if isinstance(eos, list) else [] if eos is None else [eos])
    chosen = heldout_prompts(heldout, prompts, prompt_len)
    lengths = block_lengths or list(range(2, drafter.args.block_size + 1))
    with bar("evaluate", len(lengths) * len(chosen), unit="prompts") as shown:
        return [measure_acceptance(trunk, drafter, chosen, n, new_tokens, stops,
                                   lambda: shown.update(1)) for n in lengths]  # fmt: skip


def describe(results: list[Acceptance]) -> list[str]:
    return [f"block {r.block_length}: {r.mean_accepted:.2f} drafts accepted per round "
            f"({r.mean_accepted + 1:.2f} tokens), acceptance rate {r.rate:.3f} over {r.rounds} rounds"
            for r in results]  # fmt: skip


# -- command line ------------------------------------------------------------------


def run_cli(args) -> int:
    """`specgate demo-drafter`: prepare (once), train (resumable), export, evaluate."""
    from specgate.engines.checkpoints.builtin import default_model_path
    from specgate.engines.home import models_dir

    target = Path(args.target) if args.target else default_model_path()
    out = Path(args.out) if args.out else models_dir() / "demo-dflash"
    work = Path(args.work) if args.work else out.with_name(out.name + ".work")
    cfg = DrafterConfig(seed=args.seed, steps=args.steps, batch_size=args.batch_size,
                        seq_len=args.seq_len, anchors=args.anchors, block_size=args.block_size,
                        num_layers=args.layers, target_layer_ids=args.target_layers,
                        mask_token_id=args.mask_token_id, learning_rate=args.lr,
                        decay=args.decay)  # fmt: skip
    try:
        prepare(work, target, cfg, log=main_log, max_files=args.max_files)
        result = train(work, target, out, cfg, log=main_log, stop_after=args.stop_after,
                       until_step=args.until_step)  # fmt: skip
    except WorkMismatch as e:
        main_log(f"specgate demo-drafter: {e}")
        return 2
    if result is None:
        main_log("stopped before the end: run the same command again to resume")
        return 3
    shipped = target.resolve() == default_model_path().resolve()
    record = {"target": "builtin:demo" if shipped else str(target), "config": asdict(cfg),
              "trained_steps": min(cfg.steps, args.until_step or cfg.steps)}  # fmt: skip
    if args.eval_prompts:
        held = np.load(work / "corpus.npz")["heldout"]
        results = evaluate(target, result, held, prompts=args.eval_prompts,
                           new_tokens=args.eval_new_tokens)  # fmt: skip
        main_log(f"held-out greedy DFlash decoding, {args.eval_prompts} prompts x "
                 f"{args.eval_new_tokens} new tokens:")  # fmt: skip
        for line in describe(results):
            main_log("  " + line)
        record["heldout_acceptance"] = {
            "prompts": args.eval_prompts, "prompt_tokens": 128, "new_tokens": args.eval_new_tokens,
            "per_block_length": [asdict(r) | {"rate": round(r.rate, 4),
                                              "mean_accepted": round(r.mean_accepted, 4)}
                                 for r in results],
        }  # fmt: skip
    (result / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    print(result)
    return 0
