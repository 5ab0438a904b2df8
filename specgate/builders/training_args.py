"""The trainers' settings and command-line options, apart from the trainers.

`specgate --help` builds every subcommand's options; importing the trainers
for them (MLX, numpy, the drafter modules) would cost seconds on each call,
so their settings live here, importing only the standard library.
demo_training.py (the demo model) and dflash_training.py (its DFlash
drafter) read them from here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Sizes of `specgate demo-model --size`: the Qwen3.5 hybrid's dimensions.
SIZES = {
    # ~8 M parameters: 16 MB in bfloat16, small enough to ship in the package.
    "default": dict(hidden_size=256, num_hidden_layers=8, intermediate_size=512, vocab_size=4096,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                    linear_num_key_heads=2, linear_num_value_heads=4,
                    linear_key_head_dim=64, linear_value_head_dim=64),
    # For a quick look (and the tests): trains in minutes on a CPU.
    "tiny": dict(hidden_size=64, num_hidden_layers=4, intermediate_size=128, vocab_size=1024,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                 linear_num_key_heads=1, linear_num_value_heads=2,
                 linear_key_head_dim=32, linear_value_head_dim=32),
    "large": dict(hidden_size=512, num_hidden_layers=12, intermediate_size=1536, vocab_size=8192,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                  linear_num_key_heads=4, linear_num_value_heads=8,
                  linear_key_head_dim=64, linear_value_head_dim=64),
}  # fmt: skip


@dataclass
class TrainConfig:
    size: str = "default"
    seed: int = 0
    steps: int = 3000
    batch_size: int = 32
    seq_len: int = 256
    learning_rate: float = 2e-3
    warmup_steps: int = 100
    weight_decay: float = 0.01
    mtp_weight: float = 0.5  # the head's loss weight in the joint objective
    save_every: int = 250
    dtype: str = "bfloat16"  # of the exported weights; training is float32


@dataclass
class DrafterConfig:
    seed: int = 0
    steps: int = 460
    # The target's forward over a window costs about as much as training 100
    # blocks on a CPU, so each window gives many anchors. Short windows
    # learned about twice as fast per step as 2 x 256 on the demo.
    batch_size: int = 4  # windows per step
    seq_len: int = 128  # tokens per window
    anchors: int = 48  # blocks per window, distinct anchors
    block_size: int = 8
    num_layers: int = 1
    # Spread over the demo's 8 layers, shallow to deep; a target of another
    # depth needs its own.
    target_layer_ids: list[int] = field(default_factory=lambda: [1, 3, 5, 6])
    mask_token_id: int | None = None  # None: a token id the tokenizer never emits
    learning_rate: float = 2e-3
    warmup_steps: int = 30
    weight_decay: float = 0.01
    # Position j of a block weighs exp(-(j-1)/decay). Short training makes
    # mostly the first drafts right, so the first positions get most weight.
    decay: float = 2.0
    save_every: int = 50
    dtype: str = "bfloat16"  # of the exported weights; training is float32


def add_demo_model_arguments(parser) -> None:
    """`specgate demo-model`'s options."""
    d = TrainConfig()
    parser.add_argument("--out", help="output model directory (default: $SPECGATE_HOME/models/demo-SIZE)")
    parser.add_argument("--work", help="corpus and resumable state (default: OUT.work)")
    parser.add_argument("--size", choices=sorted(SIZES), default=d.size)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--steps", type=int, default=d.steps, help="length of the LR schedule")
    parser.add_argument("--until-step", type=int, help="stop and export at this step")
    parser.add_argument("--batch-size", type=int, default=d.batch_size)
    parser.add_argument("--seq-len", type=int, default=d.seq_len)
    parser.add_argument("--lr", type=float, default=d.learning_rate)
    parser.add_argument("--stop-after", type=float, metavar="SECONDS",
                        help="save and stop after this long; the same command resumes")
    parser.add_argument("--eval-tokens", type=int, default=20_000,
                        help="held-out tokens to evaluate on at the end (0: skip)")
    parser.add_argument("--gguf", metavar="PATH", help="also export a GGUF with nextn tensors")
    _add_max_files(parser)


def _positive(text: str) -> int:
    import argparse

    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, not {text!r}")
    return int(text)


def _add_max_files(parser) -> None:
    parser.add_argument("--max-files", type=_positive, metavar="N",
                        help="train on the first N stdlib files only (a quick look; default: all)")  # fmt: skip


def _layer_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def add_demo_drafter_arguments(parser) -> None:
    """`specgate demo-drafter`'s options."""
    d = DrafterConfig()
    parser.add_argument("--target", help="target model directory (default: the shipped demo model)")
    parser.add_argument(
        "--out", help="output drafter directory (default: $SPECGATE_HOME/models/demo-dflash)"
    )
    parser.add_argument("--work", help="corpus and resumable state (default: OUT.work)")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--steps", type=int, default=d.steps, help="length of the LR schedule")
    parser.add_argument("--until-step", type=int, help="stop and export at this step")
    parser.add_argument("--batch-size", type=int, default=d.batch_size, help="windows per step")
    parser.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per window")
    parser.add_argument("--anchors", type=int, default=d.anchors, help="blocks per window")
    parser.add_argument("--block-size", type=int, default=d.block_size)
    parser.add_argument("--layers", type=int, default=d.num_layers, help="drafter decoder layers")
    parser.add_argument("--target-layers", type=_layer_list, default=d.target_layer_ids,
                        metavar="I,J,...", help="target layers the drafter reads "
                        f"(default: {','.join(map(str, d.target_layer_ids))}, for the 8-layer demo)")  # fmt: skip
    parser.add_argument("--mask-token-id", type=int,
                        help="default: the target tokenizer's byte token 0xC0, which no text produces")  # fmt: skip
    parser.add_argument("--lr", type=float, default=d.learning_rate)
    parser.add_argument("--decay", type=float, default=d.decay,
                        help="block position j weighs exp(-(j-1)/DECAY)")  # fmt: skip
    parser.add_argument("--stop-after", type=float, metavar="SECONDS",
                        help="save and stop after this long; the same command resumes")  # fmt: skip
    parser.add_argument("--eval-prompts", type=int, default=16,
                        help="held-out prompts decoded at the end, at every block length (0: skip)")  # fmt: skip
    parser.add_argument("--eval-new-tokens", type=int, default=64)
    _add_max_files(parser)
