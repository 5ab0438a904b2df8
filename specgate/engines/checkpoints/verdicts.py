"""The rules that turn what a checkpoint holds into a verdict.

Every rule that finds something wrong or unconfirmed adds a `Problem` that
names it, says what to do, and states the verdict it forces at least; the
final verdict is the worst of those and the base verdict (verified when an
MTP head or drafter is present and consistent, ar-only when there is none).
Nothing is dropped silently: a check that cannot be made is a problem too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .families import (
    GGUF_ASSISTANT_ARCHS,
    GGUF_MTP_ARCHS,
    GGUF_MTP_VERIFIED,
    GGUF_SINGLE_HEAD,
    TEXT_ONLY_MODEL_TYPES,
    Family,
    check_mtp_head,
    family_of,
    gguf_known_arch,
    mlx_lm_supports,
)
from .info import CheckpointInfo

VERDICTS = ("verified", "family-compatible", "ar-only", "no-mtp-heads", "incompatible")
_RANK = {v: i for i, v in enumerate(VERDICTS)}

_DRAFTER_NAMES = {"dflash": "DFlash", "dspark": "DSpark", "gemma4_assistant": "Gemma-4 assistant"}
_STRIP_ACTION = (
    "re-convert from the original Hugging Face checkpoint keeping mtp.* tensors, "
    "or serve plain decoding only"
)


@dataclass
class Problem:
    code: str  # stable name, e.g. "mtp_stripped", "norms_shifted_twice"
    message: str
    action: str
    verdict: str  # the verdict this forces at least


@dataclass
class EngineFit:
    engine: str
    methods: list[str]
    note: str = ""


@dataclass
class Judgement:
    base: str = "ar-only"
    family: str | None = None
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    engines: list[EngineFit] = field(default_factory=list)
    mtp_usable: bool = False  # the head can be built (even if unconfirmed)

    def problem(self, code: str, message: str, action: str, verdict: str) -> None:
        self.problems.append(Problem(code, message, action, verdict))

    @property
    def verdict(self) -> str:
        return max([self.base] + [p.verdict for p in self.problems], key=_RANK.__getitem__)


def _layers(n: int) -> str:
    return f"{n} MTP layer{'s' if n != 1 else ''}"


# ---------------------------------------------------------------- targets


def _offset(mean: float) -> int | None:
    """Which stored offset (0: w, 1: 1+w, 2: 2+w) a norm mean sits on, if clear."""
    best = min((0, 1, 2), key=lambda o: abs(mean - o))
    return best if abs(mean - best) <= 0.3 else None


def _judge_norms(info: CheckpointInfo, j: Judgement) -> None:
    ev = info.norms
    if ev is None or ev.trunk_mean is None:
        j.problem("norms_unchecked", "no layer norm weights could be read to check the "
                  "zero-centred norm convention", "check the checkpoint converts and "
                  "generates sensibly with plain decoding first", "family-compatible")
        return
    # Raw HF stores w (so ~0); mlx-lm's sanitize stores 1 + w and moves the
    # conv1d axes in the same pass. The layout says which one to expect.
    expected = 1 if ev.layout == "mlx" else 0
    conv = f"conv1d {list(ev.conv1d_shape)}" if ev.conv1d_shape else "no conv1d"
    layout = ("mlx layout [C,K,1]" if ev.layout == "mlx" else "Hugging Face layout [C,1,K]")
    stored = _offset(ev.trunk_mean)
    j.notes.append(f"norm evidence: layer norms median mean {ev.trunk_mean:.3f} over "
                   f"{ev.trunk_tensors} tensors, {conv}"
                   + (f", MTP norms {ev.mtp_mean:.3f}" if ev.mtp_mean is not None else ""))
    if stored is None:
        j.problem("norms_inconclusive",
                  f"layer norms have median mean {ev.trunk_mean:.3f}, neither near "
                  f"{expected} (what {layout} implies) nor near another offset",
                  "compare a plain greedy generation against the original model", "family-compatible")
    elif stored > expected:
        # What the loader makes of it: mlx-lm adds 1 only to raw-HF layout.
        scale = stored + (1 - expected)
        j.problem("norms_shifted_twice",
                  f"norms shifted twice: the layer norms are stored near {stored}.0 (median mean "
                  f"{ev.trunk_mean:.3f}) while conv1d is in {layout}, so every norm loads as "
                  f"{scale} + w instead of 1 + w (mlx-lm PR #1456)",
                  "re-convert from the original Hugging Face checkpoint (zero-centred norms "
                  "stored near 0) with an unpatched converter; do not serve this copy",
                  "incompatible")
    elif stored < expected:
        j.problem("norms_not_shifted",
                  f"norms never shifted: the layer norms are stored near 0 (median mean "
                  f"{ev.trunk_mean:.3f}) but conv1d is already in {layout}, so nothing adds the "
                  "+1 and every norm scales by about w",
                  "re-convert from the original Hugging Face checkpoint with mlx-lm's convert; "
                  "do not serve this copy", "incompatible")
    if ev.mtp_mean is not None:
        m = _offset(ev.mtp_mean)
        if m != expected:
            code = ("mtp_norms_inconclusive" if m is None else
                    "mtp_norms_shifted" if m > expected else "mtp_norms_not_shifted")
            j.problem(code,
                      f"the MTP head's norms are stored with median mean {ev.mtp_mean:.3f}, "
                      f"but {layout} implies stored values near {expected}: the head would load "
                      "with wrongly scaled norms; drafts stay exact (every token is verified) "
                      "but acceptance collapses",
                      "re-convert keeping mtp.* exactly as the original checkpoint stores them, "
                      "or serve without MTP", "family-compatible")


def _judge_scale_norms(info: CheckpointInfo, j: Judgement, what: str) -> None:
    """Gemma-4 scales by the stored weight (x * w), so its layer norms sit
    near 1. Stored near 0 they were written for a (1 + w) convention
    (Gemma-2/3's): loaded as Gemma-4 defines them, every norm scales by
    about w. Ports of the assistant that got this wrong drafted at 0 %."""
    ev = info.norms
    if ev is None or ev.trunk_mean is None:
        j.problem("norms_unchecked", f"no layer norm weights of the {what} could be read to check "
                  "Gemma-4's norm convention", "compare a greedy generation against the "
                  "original model", "family-compatible")
        return
    j.notes.append(f"norm evidence: {what}'s layer norms median mean {ev.trunk_mean:.3f} over "
                   f"{ev.trunk_tensors} tensors (Gemma-4 stores the scale: near 1)")
    stored = _offset(ev.trunk_mean)
    if stored == 0:
        j.problem("norms_shifted",
                  f"the {what}'s layer norms are stored near 0 (median mean {ev.trunk_mean:.3f}), "
                  "as a (1 + w) convention stores them; Gemma-4's RMSNorm is x * w, so every "
                  "norm would scale by about w",
                  "re-convert from the original Hugging Face checkpoint without shifting the "
                  "norms; do not serve this copy", "incompatible")
    elif stored is None:
        j.problem("norms_inconclusive",
                  f"the {what}'s layer norms have median mean {ev.trunk_mean:.3f}, not near 1 "
                  "(Gemma-4 stores the scale itself)",
                  "compare a greedy generation against the original model", "family-compatible")


def _judge_mtp(info: CheckpointInfo, fam: Family | None, j: Judgement) -> None:
    mtp = info.mtp
    where = "model.layers.{N}.* nextn" if fam and fam.mtp_style == "nextn" else "mtp.*"
    if mtp.present == 0:
        if mtp.declared > 0:
            how = ("a text-only save drops them (transformers' *ForCausalLM ignores mtp.* on "
                   "load)" if info.model_type in TEXT_ONLY_MODEL_TYPES else
                   "the converter stripped them (mlx-lm's sanitize drops mtp.*)")
            j.problem("mtp_stripped",
                      f"config declares {_layers(mtp.declared)} ({mtp.declared_key}) but the "
                      f"weights hold no {where} tensors: {how}", _STRIP_ACTION, "no-mtp-heads")
        elif fam and fam.mtp_style and fam.mtp_key is None:
            # Nothing to compare against: the releases declare no MTP layers.
            j.problem("mtp_maybe_stripped",
                      f"{info.model_type} releases ship an {where} head without declaring it in "
                      "config.json; this checkpoint holds none, so a converter may have "
                      "stripped it", _STRIP_ACTION, "ar-only")
        return
    if fam is None or fam.mtp_style is None:
        j.problem("mtp_unsupported_family",
                  f"the weights hold an MTP head ({mtp.prefix}*) but specgate implements no MTP "
                  f"head for model_type {info.model_type}",
                  "serve plain decoding only, or pair a DFlash/DSpark drafter", "ar-only")
        return
    if mtp.style != fam.mtp_style:
        j.problem("mtp_layout_unexpected",
                  f"{fam.name} keeps its MTP head as {fam.mtp_style}, but this checkpoint has "
                  f"it as {mtp.prefix}*", "re-convert from the original checkpoint", "incompatible")
        return
    missing, wrong = check_mtp_head(info)
    if missing or wrong:
        detail = "; ".join(([f"missing {', '.join(missing[:4])}"] if missing else []) + wrong[:4])
        j.problem("mtp_head_inconsistent",
                  f"the MTP head does not match the config: {detail}",
                  "re-convert from the original checkpoint, or serve plain decoding only",
                  "incompatible")
        return
    j.base = "verified"
    j.mtp_usable = True
    if not fam.mtp_verified:
        j.problem("family_unconfirmed",
                  f"{fam.name}: specgate's MTP head has not been checked against this family's "
                  "published layout", "measure acceptance with specgate tune before relying on it",
                  "family-compatible")
    if mtp.declared == 0 and fam.mtp_key is None:
        j.notes.append(f"{_layers(mtp.present)} found by their tensors; {info.model_type} configs "
                       "declare none (vLLM defaults num_nextn_predict_layers to 1)")
    elif mtp.declared == 0:
        j.problem("mtp_undeclared",
                  f"the weights hold {_layers(mtp.present)} but the config declares none "
                  "(no mtp_num_hidden_layers / num_nextn_predict_layers)",
                  f"add \"{fam.mtp_key}\": {mtp.present} to the config",
                  "family-compatible")
    elif mtp.declared != mtp.present:
        j.problem("mtp_layer_count",
                  f"config declares {_layers(mtp.declared)} but the weights hold {mtp.present}",
                  "re-convert keeping every mtp.layers.* tensor", "family-compatible")
    if mtp.prefix not in ("mtp.", None) and mtp.style == "qwen":
        j.problem("mtp_prefix",
                  f"the MTP head sits under {mtp.prefix}*, not the published top-level mtp.*",
                  "re-convert from the original checkpoint", "family-compatible")
    if mtp.sidecar:
        j.notes.append(f"MTP head read from the sidecar {mtp.sidecar}")
    if info.layout == "mlx":
        j.problem("mtp_mlx_layout",
                  "an MTP head in an mlx-converted checkpoint: mlx-lm's converter drops mtp.*, "
                  "so this one came from another tool whose layout no published source confirms",
                  "prefer the original Hugging Face checkpoint for MTP", "family-compatible")


_TOKENIZER_ACTION = "copy the original model's tokenizer files (tokenizer.json, tokenizer_config.json) into it"


def _judge_tokenizer(info: CheckpointInfo, j: Judgement) -> None:
    """A target tokenizes every request: without a usable tokenizer it cannot
    serve, without a chat template it serves completions only."""
    t = info.tokenizer
    if t is None:  # a GGUF: llama.cpp reads the tokenizer embedded in it
        return
    if t.error:
        j.problem("tokenizer_unreadable", f"the tokenizer files cannot be read ({t.error})",
                  _TOKENIZER_ACTION, "incompatible")
        return
    if not t.vocab_files:
        missing = "tokenizer.json" + ("" if t.config_file else " / tokenizer_config.json")
        j.problem("no_tokenizer",
                  f"no tokenizer ({missing} missing, no tokenizer.model or vocab.json either): "
                  "specgate refuses to load it, as every prompt would encode to no tokens",
                  _TOKENIZER_ACTION, "incompatible")
        return
    vocab = info.vocab_size
    if t.max_token_id is not None and vocab and t.max_token_id >= vocab:
        j.problem("tokenizer_vocab",
                  f"the tokenizer has ids up to {t.max_token_id}, but the model's vocabulary ends "
                  f"at {vocab - 1} (vocab_size {vocab}): those tokens have no embedding",
                  "pair the checkpoint with the tokenizer it was trained with", "incompatible")
    if t.chat_template is None:
        j.problem("no_chat_template",
                  "no chat template (none in tokenizer_config.json, no chat_template.jinja): "
                  "it serves /v1/completions, but chat requests (/v1/chat/completions, "
                  "/v1/messages) are refused",
                  "copy the original model's chat template (tokenizer_config.json's "
                  "chat_template, or chat_template.jinja) into it", "family-compatible")


def judge_target(info: CheckpointInfo) -> Judgement:
    fam = family_of(info)
    j = Judgement(family=fam.name if fam else None)
    for err in info.errors:
        j.problem("incomplete", err, "finish the download (every shard the index names)",
                  "incompatible")
    plain = mlx_lm_supports(info.model_type)
    if not plain:
        j.problem("unsupported_architecture",
                  f"model_type {info.model_type!r} is not an architecture mlx-lm (hence specgate) "
                  "can load", "use a supported model, or a GGUF of it with the llamacpp engine",
                  "incompatible")
    _judge_tokenizer(info, j)
    if fam and fam.zero_centred:
        _judge_norms(info, j)
    elif fam and fam.scale_norms:
        _judge_scale_norms(info, j, "model")
    _judge_mtp(info, fam, j)
    if fam is None and plain:
        j.notes.append(f"model_type {info.model_type}: plain decoding through mlx-lm")
    q = info.quantization
    if q and q.source == "hf":
        j.notes.append(f"{q.description}: loads only where mlx-lm's sanitize dequantizes it")
    if j.verdict != "incompatible":
        j.engines.append(EngineFit("mlx_plain", ["none"]))
        if j.mtp_usable:
            j.engines.append(EngineFit("mlx_mtp", ["mtp"]))
        if (info.model_type or "").startswith("gemma4"):
            j.engines.append(EngineFit("mlx_assistant", ["gemma4_assistant"],
                                       "with the -assistant drafter released for this model"))
        j.engines.append(EngineFit("mlx_dflash", ["dflash"],
                                   "with a DFlash drafter trained for this target"))
        j.engines.append(EngineFit("mlx_dspark", ["dspark"],
                                   "with a DSpark drafter trained for this target"))
        # Drafts copied from the context: nothing but the model itself.
        j.engines.append(EngineFit("mlx_ngram", ["ngram"], "drafts copied from the context"))
    return j


# ---------------------------------------------------------------- drafters


def judge_drafter(info: CheckpointInfo, target: CheckpointInfo | None,
                  target_judgement: Judgement | None) -> Judgement:
    d = info.drafter
    name = _DRAFTER_NAMES[d.kind]
    j = Judgement(base="verified", family=f"{name} drafter")
    for err in info.errors:
        j.problem("incomplete", err, "finish the download", "incompatible")
    if d.kind == "dspark":
        j.problem("dspark_layout_unconfirmed",
                  "DSpark's published file layout is UNCONFIRMED (DeepSpec's modeling code is "
                  "public, its released checkpoints' tensor names were not checked)",
                  "compare acceptance and exactness against plain decoding before relying on it",
                  "family-compatible")
        if d.markov_rank == 0:
            j.notes.append("markov_rank 0: DeepSpec's dflash_* variant (DSpark alignment)")
    if d.kind in ("dflash", "dspark"):
        if not d.target_layer_ids:
            j.problem("no_target_layer_ids", f"{name} drafter config names no target_layer_ids",
                      "add dflash_config.target_layer_ids from the drafter's training recipe",
                      "incompatible")
        elif d.target_hidden_size is None:
            j.problem("no_fc", f"{name} drafter has no fc.weight whose width is a multiple of "
                      f"its {len(d.target_layer_ids)} target layers",
                      "re-download the drafter", "incompatible")
    else:
        _judge_scale_norms(info, j, "assistant")
        pre = info.tensors.get("pre_projection.weight")
        hb, hd = d.target_hidden_size, d.hidden_size
        if pre is None:
            j.problem("no_pre_projection", "Gemma-4 assistant without pre_projection.weight",
                      "re-download the drafter", "incompatible")
        elif hb and hd and pre.shape != (hd, 2 * hb):
            j.problem("pre_projection_shape",
                      f"pre_projection is {list(pre.shape)}, expected [{hd}, {2 * hb}] from "
                      f"hidden_size {hd} and backbone_hidden_size {hb}",
                      "re-download the drafter", "incompatible")
    if target is None:
        j.notes.append("not checked against a target: run `specgate inspect DRAFTER --target TARGET`")
    else:
        _judge_pairing(info, target, target_judgement, j)
    if j.verdict != "incompatible":
        engine = "mlx_assistant" if d.kind == "gemma4_assistant" else f"mlx_{d.kind}"
        j.engines.append(EngineFit(engine, [d.kind], "paired with its target"))
    return j


def _judge_pairing(info: CheckpointInfo, target: CheckpointInfo, tj: Judgement | None,
                   j: Judgement) -> None:
    d = info.drafter
    name = _DRAFTER_NAMES[d.kind]
    if d.kind == "gemma4_assistant":
        action = ("pair the Gemma-4 assistant with the Gemma-4 model it was released for "
                  "(backbone_hidden_size and vocabulary equal to the target's)")
    else:
        action = (f"pair the {name} drafter with the target it was trained for (same hidden "
                  "size, vocabulary and layer count)")

    def mismatch(code: str, message: str) -> None:
        j.problem(code, message, action, "incompatible")

    if target.format != "safetensors":
        mismatch("target_format", f"{name} drafters run in MLX beside an MLX target; the target "
                 f"is a {target.format} file")
        return
    if target.drafter is not None:
        mismatch("target_is_drafter", f"the target is itself a {_DRAFTER_NAMES[target.drafter.kind]}"
                 " drafter")
        return
    if tj is not None and tj.verdict == "incompatible":
        reasons = "; ".join(p.message for p in tj.problems if p.verdict == "incompatible")
        mismatch("target_incompatible", f"the target cannot be served: {reasons}")
    if d.kind == "gemma4_assistant" and not (target.model_type or "").startswith("gemma4"):
        mismatch("target_family", f"a Gemma-4 assistant drafts for Gemma-4 targets; the target "
                 f"is {target.model_type}")
    if d.kind == "gemma4_assistant":
        for what in _gemma4_mismatches(info.text_config, target.text_config):
            mismatch("target_attention", what)
    th = target.hidden_size
    if d.target_hidden_size and th and d.target_hidden_size != th:
        mismatch("target_hidden_size", f"{name} drafter expects target hidden size "
                 f"{d.target_hidden_size}, the target has {th}")
    if d.vocab_size and target.vocab_size and d.vocab_size != target.vocab_size:
        mismatch("target_vocab", f"{name} drafter has a vocabulary of {d.vocab_size} tokens, "
                 f"the target has {target.vocab_size}")
    tl = target.num_hidden_layers
    if d.num_target_layers and tl and d.num_target_layers != tl:
        mismatch("target_layers", f"{name} drafter was trained on a {d.num_target_layers}-layer "
                 f"target (num_target_layers), the target has {tl} layers")
    elif d.target_layer_ids and tl and max(d.target_layer_ids) >= tl:
        mismatch("target_layer_ids", f"{name} drafter reads target layers {d.target_layer_ids}, "
                 f"the target has {tl} layers")
    if not any(p.code.startswith("target_") for p in j.problems):
        j.notes.append(f"target {target.path}: hidden {th}, vocab {target.vocab_size}, "
                       f"{tl} layers; matches the drafter")


def _gemma4_mismatches(mine: dict, target: dict) -> list[str]:
    """What an assistant's attention cannot share with the target's K/V:
    head widths per attention type, K/V heads, the sliding window."""
    out = []
    for key in ("head_dim", "global_head_dim", "sliding_window"):
        a, b = mine.get(key), target.get(key)
        if a and b and a != b:
            out.append(f"the assistant's {key} is {a}, the target's {b}")
    heads, kv = mine.get("num_attention_heads"), target.get("num_key_value_heads")
    if heads and kv and heads % kv:
        out.append(f"the assistant's {heads} query heads cannot share the target's {kv} K/V heads")
    return out


# ---------------------------------------------------------------- GGUF


def judge_gguf(info: CheckpointInfo) -> Judgement:
    g = info.gguf
    j = Judgement(family=f"GGUF {g.arch}")
    if not gguf_known_arch(g.arch):
        j.problem("unsupported_architecture", f"GGUF architecture {g.arch!r} is unknown to "
                  "llama.cpp", "use a GGUF of a supported architecture", "incompatible")
    n, blocks = g.nextn_predict_layers, g.nextn_blocks
    if g.arch in GGUF_ASSISTANT_ARCHS:
        # Its nextn_predict_layers counts its own layers; it has no nextn blocks.
        j.base = "verified"
        j.notes.append(f"a {g.arch} drafter: serve it as the `drafter:` of the "
                       f"{GGUF_ASSISTANT_ARCHS[g.arch]} GGUF it was released for, with llamacpp_mtp "
                       "(llama-server -md)")
    elif g.arch in GGUF_ASSISTANT_ARCHS.values():
        j.notes.append(f"{g.arch} drafts with a separate -assistant GGUF (its repo's MTP/ folder): "
                       "set it as the model's `drafter:` for llamacpp_mtp")
    elif n > 0 and not blocks:
        j.problem("mtp_stripped",
                  f"the GGUF declares {_layers(n)} ({g.arch}.nextn_predict_layers) but holds no "
                  "blk.N.nextn.* tensors: it was converted without the head (--no-mtp, or from a "
                  "checkpoint whose mtp.* tensors were already stripped)",
                  "re-convert with llama.cpp's convert_hf_to_gguf.py from a checkpoint that keeps "
                  "mtp.* tensors, or serve plain decoding only", "no-mtp-heads")
    elif blocks and n == 0:
        j.problem("mtp_undeclared",
                  f"the GGUF holds blk.{blocks[0]}.nextn.* tensors but no "
                  f"{g.arch}.nextn_predict_layers, so llama.cpp ignores the head",
                  "re-convert with an MTP-aware convert_hf_to_gguf.py", "ar-only")
    elif blocks:
        expected = list(range(g.block_count - n, g.block_count)) if g.block_count else blocks
        if g.arch not in GGUF_MTP_ARCHS:
            j.problem("mtp_unsupported_family", f"llama.cpp has no MTP graph for {g.arch}",
                      "serve plain decoding only", "ar-only")
        elif blocks != expected:
            j.problem("mtp_head_inconsistent",
                      f"nextn tensors sit in blocks {blocks}, but block_count {g.block_count} with "
                      f"nextn_predict_layers {n} puts them in {expected}",
                      "re-convert with llama.cpp's convert_hf_to_gguf.py", "incompatible")
        elif g.arch in GGUF_SINGLE_HEAD and n != 1:
            j.problem("mtp_layer_count", f"llama.cpp's {g.arch} MTP supports exactly one nextn "
                      f"layer; this GGUF has {n}", "re-convert with one MTP layer", "incompatible")
        else:
            j.base, j.mtp_usable = "verified", True
            if g.arch not in GGUF_MTP_VERIFIED:
                j.problem("family_unconfirmed",
                          f"llama.cpp has an MTP graph for {g.arch}, but specgate has only run "
                          "qwen35/qwen35moe heads end to end", "measure acceptance before relying "
                          "on it", "family-compatible")
    if info.tokenizer is not None and not info.tokenizer.vocab_files:
        j.problem("no_tokenizer", "no tokenizer (no tokenizer.ggml.tokens): llama-server cannot "
                  "load it", "re-convert with llama.cpp's convert_hf_to_gguf.py from a checkpoint "
                  "that has its tokenizer files", "incompatible")
    if j.verdict != "incompatible":
        if g.arch in GGUF_ASSISTANT_ARCHS:
            j.engines.append(EngineFit("llamacpp_mtp", ["llamacpp_mtp"], "as a target's drafter"))
        elif g.arch in GGUF_ASSISTANT_ARCHS.values():
            j.engines.append(EngineFit("llamacpp", ["none", "llamacpp_mtp"],
                                       "llamacpp_mtp with the -assistant GGUF as `drafter:`"))
        else:
            j.engines.append(EngineFit("llamacpp", ["none"] + (["llamacpp_mtp"] if j.mtp_usable else [])))
        if g.arch not in GGUF_ASSISTANT_ARCHS:  # a drafter alone decodes nothing
            j.engines.append(EngineFit("llamacpp_ngram", ["llamacpp_ngram"],
                                       "drafts copied from the context"))
    return j
