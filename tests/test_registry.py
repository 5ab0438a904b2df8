"""specgate/engines/registry.py: one record per engine, the one place that lists them.

Config validation, engine construction, the policy and tuning iterate over
it, so an engine added there (here: fake records, made for these tests
only) is served without editing gateway/ or policies/."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from specgate.engines import registry
from specgate.engines.base import PLAIN
from specgate.engines.registry import GGUF, MLX, BuildContext, EngineRecord
from specgate.engines.settings import BlockSettings, MTPSettings

REPO = Path(__file__).resolve().parents[1]


class FakeEngine:
    """Stands in for an engine: records and builders only pass it around."""

    def __init__(self, name: str, model_id: str = "m"):
        self.name, self.model_id = name, model_id
        self.max_drafts = 5


def _fake_builder(calls: list):
    def build(ctx: BuildContext, names: tuple[str, ...]):
        calls.append(names)
        return {n: FakeEngine(n, ctx.model_id) for n in names}, {}

    return build


def test_the_records_list_the_methods():
    assert registry.methods() == ("none", "mtp", "dflash", "dspark", "gemma4_assistant", "ngram",
                                  "mtp+ngram", "llamacpp_mtp", "llamacpp_ngram")
    assert registry.methods()[0] == PLAIN
    for r in registry.records():
        assert registry.record(r.name) is r and registry.method_of(r.name) == r.method


def test_every_format_has_a_default_plain_engine_and_names_are_unique():
    assert len(set(registry.names())) == len(registry.names())
    for fmt in (MLX, GGUF):
        defaults = [r for r in registry.records(fmt) if r.default]
        assert len(defaults) == 1 and not defaults[0].speculative
    assert set(registry.names(MLX)) | set(registry.names(GGUF)) == set(registry.names())


def test_records_describe_the_engines():
    r = {rec.name: rec for rec in registry.records()}
    assert r["mlx_plain"].always and not any(x.always for x in registry.records(GGUF))
    assert r["mlx_mtp"].needs == "mtp_head" and r["llamacpp_mtp"].needs == "mtp_head"
    assert (r["mlx_dflash"].drafter_kind, r["mlx_dspark"].drafter_kind,
            r["mlx_assistant"].drafter_kind) == ("dflash", "dspark", "gemma4_assistant")
    assert registry.excludes("mlx_dflash") == ("mlx_dspark", "mlx_assistant")
    assert registry.excludes("mlx_dspark") == ("mlx_dflash", "mlx_assistant")
    assert registry.excludes("mlx_mtp") == ()
    assert [n for n, x in r.items() if x.fixed_depth] == ["llamacpp_mtp", "llamacpp_ngram"]
    assert [n for n, x in r.items() if x.times_rounds] == ["mlx_plain", "mlx_mtp", "mlx_dflash",
                                                            "mlx_dspark", "mlx_assistant",
                                                            "mlx_ngram", "mlx_mtp_ngram"]
    # A copying proposer has nothing to copy in tune's random prompt: not timed there.
    assert [n for n, x in r.items() if x.tune] == ["mlx_mtp", "mlx_dflash", "mlx_dspark",
                                                   "mlx_assistant"]
    assert r["mlx_ngram"].needs == "nothing" and r["mlx_mtp_ngram"].needs == "mtp_head"
    # llama.cpp's engines are built together, from one read of the GGUF.
    assert r["llamacpp"].build is r["llamacpp_mtp"].build is r["llamacpp_ngram"].build
    assert len({x.build for x in registry.records(MLX)}) == len(registry.records(MLX))
    ctx = BuildContext("m", "p", MLX, settings={"mlx_mtp": MTPSettings(depth=3)})
    engine = FakeEngine("mlx_dflash")  # max_drafts 5

    def depth(name: str, **given) -> int:
        settings = r[name].settings(**given) if given else ctx.settings_of(name)
        return r[name].depth(settings, engine)

    assert depth("mlx_dflash") == 5 and r["mlx_dflash"].depth_cap(engine) == 5
    assert depth("mlx_dspark", depth=2) == 2 and depth("mlx_mtp") == 3
    assert depth("mlx_assistant") == 2  # its record's default: set per engine
    assert depth("mlx_dflash", depth=9) == 5
    assert depth("mlx_ngram", depth=12) == depth("mlx_mtp_ngram", depth=12) == 12
    assert depth("llamacpp_ngram", depth=12) == 12 and depth("llamacpp_ngram") == 8
    # Each record's settings class, which the config makes the engine's YAML key.
    assert {n: x.settings.__name__ for n, x in r.items()} == {
        "mlx_plain": "EngineSettings", "mlx_mtp": "MTPSettings", "mlx_dflash": "BlockSettings",
        "mlx_dspark": "BlockSettings", "mlx_assistant": "MTPSettings",
        "mlx_ngram": "NgramSettings", "mlx_mtp_ngram": "MTPNgramSettings",
        "llamacpp": "EngineSettings", "llamacpp_mtp": "MTPSettings",
        "llamacpp_ngram": "LlamaCppNgramSettings"}


def test_a_shared_builder_builds_once_with_the_names_in_the_config_order():
    calls_pair, calls_one = [], []
    pair, one = _fake_builder(calls_pair), _fake_builder(calls_one)
    fakes = (EngineRecord("fake_a", PLAIN, GGUF, pair), EngineRecord("fake_b", "mtp", GGUF, pair),
             EngineRecord("fake_c", "dflash", GGUF, one))
    with registry.registered(*fakes):
        ctx = BuildContext("m", "x.gguf", GGUF, engines=("fake_c", "fake_b", "fake_a"))
        built, refused = registry.build_engines(ctx)
    assert calls_pair == [("fake_b", "fake_a")] and calls_one == [("fake_c",)]
    assert list(built) == ["fake_b", "fake_a", "fake_c"] and refused == {}
    assert "fake_a" not in registry.names()  # gone with the block


def test_register_refuses_a_name_twice():
    with pytest.raises(ValueError, match="registered already"):
        registry.register(EngineRecord("mlx_plain", PLAIN, MLX, _fake_builder([])))


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


def test_the_registry_imports_neither_gateway_nor_policies():
    found = _imports(REPO / "specgate/engines/registry.py")
    assert not [m for m in found if m.split(".")[:2] in (["specgate", "gateway"], ["specgate", "policies"])], found


# ---------------------------------------------------------------- config validation


def _config(tmp_path, fmt, engines, **extra):
    from specgate.gateway.config import parse_config

    (tmp_path / "m.gguf").touch()
    path = str(tmp_path / "m.gguf") if fmt == GGUF else "some/dir"
    return parse_config({"models": [{"id": "m", "path": path, "engines": engines, **extra}]})


def _error(tmp_path, fmt, engines, **extra) -> str:
    from specgate.gateway.config import ConfigError

    with pytest.raises(ConfigError) as err:
        _config(tmp_path, fmt, engines, **extra)
    return str(err.value)


@pytest.mark.parametrize("fmt", [MLX, GGUF], ids=lambda f: f.name)
def test_config_accepts_exactly_the_registry_engines_of_a_format(tmp_path, fmt):
    for r in registry.records():
        drafter = {"drafter": "builtin:demo-dflash"} if r.needs == "drafter" else {}
        if r.format == fmt:
            assert _config(tmp_path, fmt, [r.name], **drafter).models[0].engines == [r.name]
        else:
            message = _error(tmp_path, fmt, [r.name], **drafter)
            if fmt == GGUF and r.format.in_process:
                # MLX engines take a GGUF they can import (tests/test_gguf_import.py):
                # not this empty file, nor one without the MTP head an engine drafts with.
                assert "cannot serve" in message or "MTP head" in message, message
                continue
            assert f"cannot serve {fmt.description}" in message
            assert " / ".join(registry.names(fmt)) in message, message
    default = [r.name for r in registry.records(fmt) if r.default]
    assert _config(tmp_path, fmt, []).models[0].engines == default


def test_a_made_up_engine_is_refused_with_the_valid_ones(tmp_path):
    message = _error(tmp_path, MLX, ["mlx_plain", "mlx_warp"])
    assert "models.0.engines.1" in message and "'mlx_warp'" in message
    assert ", ".join(registry.names()) in message, message


def test_one_engine_of_an_exclusive_group_and_the_drafter_it_needs(tmp_path):
    message = _error(tmp_path, MLX, ["mlx_dflash", "mlx_dspark"], drafter="builtin:demo-dflash")
    assert "one drafter per model: mlx_dflash or mlx_dspark, not both" in message
    assert "mlx_dspark needs a `drafter`" in _error(tmp_path, MLX, ["mlx_plain", "mlx_dspark"])
    message = _error(tmp_path, MLX, ["mlx_plain"], drafter="builtin:demo-dflash")
    assert "`drafter` goes with an engine that drafts with it (mlx_dflash / mlx_dspark / " \
        "mlx_assistant)" in message
    # A GGUF model's drafter is a .gguf for llamacpp_mtp's -md (Gemma-4's assistant).
    assert "llamacpp_mtp" in _error(tmp_path, GGUF, ["llamacpp"], drafter="builtin:demo-dflash")
    assert "a GGUF model's drafter is a .gguf file" in _error(
        tmp_path, GGUF, ["llamacpp", "llamacpp_mtp"], drafter="builtin:demo-dflash")


def _fake_records(calls: list) -> tuple[EngineRecord, ...]:
    """Engines that do not exist, for these tests only: one that drafts
    through a made-up method, and a GGUF one built with its sibling."""
    pair = _fake_builder(calls)
    return (
        EngineRecord("mlx_fake", "fake", MLX, _fake_builder(calls),  # type: ignore[arg-type]
                     depth=lambda settings, e: 3, depth_cap=lambda e: e.max_drafts),
        EngineRecord("gguf_fake", "gguf_fake", GGUF, pair,  # type: ignore[arg-type]
                     settings=MTPSettings, depth=lambda settings, e: settings.depth,
                     fixed_depth=True, times_rounds=False),
        EngineRecord("gguf_fake_plain", PLAIN, GGUF, pair, times_rounds=False),
    )


def test_a_new_record_is_accepted_by_the_config(tmp_path):
    with registry.registered(*_fake_records([])):
        assert _config(tmp_path, MLX, ["mlx_plain", "mlx_fake"]).models[0].engines == [
            "mlx_plain", "mlx_fake"]
        assert "use mlx_plain / mlx_mtp / mlx_dflash / mlx_dspark / mlx_assistant / mlx_ngram / mlx_mtp_ngram / mlx_fake" in _error(
            tmp_path, MLX, ["gguf_fake"])
        assert "mlx_fake" in _error(tmp_path, MLX, ["warp"])  # the list names it
    assert "no such engine" in _error(tmp_path, MLX, ["mlx_fake"])  # and forgets it after


# ---------------------------------------------------------------- engines and policy


def test_a_new_record_is_built_and_planned_without_editing_gateway_or_policies(tmp_path):
    from specgate.engines.base import LiveState
    from specgate.gateway.serving.models import ServedModel, _policy, build_model_engines
    from specgate.policies.decide import RequestFeatures, decide

    calls = []
    with registry.registered(*_fake_records(calls)):
        # A GGUF model served by the fake pair: built by one call of their builder.
        # (A record registered after the config module built its fields gets
        # its settings' defaults: MTPSettings' depth 2.)
        config = _config(tmp_path, GGUF, ["gguf_fake_plain", "gguf_fake"])
        mc = config.models[0]
        served = ServedModel(mc)
        context, served.engines, served.refused = build_model_engines(mc, config.llama_server, config.prefix_cache)
        assert calls == [("gguf_fake_plain", "gguf_fake")] and list(served.engines) == [
            "gguf_fake_plain", "gguf_fake"]
        assert served.engine is served.engines["gguf_fake_plain"]
        live = _policy(served, context)
        p = live.policy
        assert p.engines_by_method == {"gguf_fake": "gguf_fake", PLAIN: "gguf_fake_plain"}
        assert p.fixed_depth == ("gguf_fake",) and p.depth("gguf_fake") == 2
        assert live.timed == frozenset()  # neither times its rounds

        # An MLX model with the fake drafting engine beside the plain one.
        config = _config(tmp_path, MLX, ["mlx_plain", "mlx_fake"], policy={"depth": 2})
        served = ServedModel(config.models[0])
        served.engines = {"mlx_plain": FakeEngine("mlx_plain"), "mlx_fake": FakeEngine("mlx_fake")}
        from specgate.gateway.serving.models import build_context

        live = _policy(served, build_context(served.config, config.llama_server))
        p = live.policy
        assert p.engines_by_method == {"fake": "mlx_fake", PLAIN: "mlx_plain"}
        assert p.caps == {"fake": 5} and p.depth("fake") == 2  # the config's depth, under its cap
        assert live.timed == frozenset({PLAIN, "fake"})
        plan = decide(p, RequestFeatures(20, False), LiveState(0, 0, 0))  # idle: speculate
        assert (plan.engine, plan.method, plan.depth) == ("mlx_fake", "fake", 2)


def test_the_policy_reads_depths_caps_and_order_from_the_records(tmp_path):
    from specgate.policies.config import PolicyConfig
    from specgate.policies.model_policy import build_policy, timed_methods

    stubs = {n: FakeEngine(n) for n in ("mlx_plain", "mlx_mtp", "mlx_dspark")}  # max_drafts 5
    ctx = BuildContext("m", "p", MLX, settings={"mlx_mtp": MTPSettings(depth=3)})
    p = build_policy("m", stubs, {}, PolicyConfig(), context=ctx, params=None)
    assert list(p.engines_by_method) == ["mtp", "dspark", PLAIN]  # speculative first, as built
    assert (p.depths, p.caps, p.fixed_depth, p.max_depth) == ({"mtp": 3, "dspark": 5},
                                                              {"dspark": 5}, (), 5)
    ctx = BuildContext("m", "p", MLX, settings={"mlx_mtp": MTPSettings(depth=3),
                                                "mlx_dspark": BlockSettings(depth=4)})
    assert build_policy("m", stubs, {}, PolicyConfig(), context=ctx, params=None).depths == {
        "mtp": 3, "dspark": 4}
    p = build_policy("m", stubs, {}, PolicyConfig(depth=6), context=ctx, params=None)
    assert p.depths == {"mtp": 6, "dspark": 5} and not p.auto_depth
    assert timed_methods(stubs) == {PLAIN, "mtp", "dspark"}

    stubs = {n: FakeEngine(n) for n in ("llamacpp_mtp", "llamacpp")}
    ctx = BuildContext("m", "m.gguf", GGUF, settings={"llamacpp_mtp": MTPSettings(depth=4)})
    p = build_policy("m", stubs, {}, PolicyConfig(depth=2), context=ctx, params=None)
    assert p.engines_by_method == {"llamacpp_mtp": "llamacpp_mtp", PLAIN: "llamacpp"}
    assert p.fixed_depth == ("llamacpp_mtp",) and p.depth("llamacpp_mtp") == 4  # set at start
    assert timed_methods(stubs) == frozenset()
    p = build_policy("m", {"llamacpp": stubs["llamacpp"]}, {"llamacpp_mtp": "no MTP layers"},
                     PolicyConfig(), context=ctx, params=None)
    assert p.refused == {"llamacpp_mtp": "no MTP layers"}


# ---------------------------------------------------------------- what names engines


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def test_gateway_and_policies_spell_out_no_engine_and_no_speculative_method():
    """Only the registry lists engines: code in gateway/ and policies/ names
    none (comments and docstrings may); policies/ may name plain decoding
    ("none"), whose rules are about it."""
    import re

    words = re.compile(r"\b(" + "|".join(map(re.escape, registry.names())) + r")\b")
    methods = {m for m in registry.methods() if m != PLAIN}
    found = []
    for path in sorted([*REPO.glob("gateway/*.py"), *REPO.glob("policies/*.py")]):
        tree = ast.parse(path.read_text())
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and id(node) not in docs
                    and (node.value in methods or words.search(node.value))):  # fmt: skip
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.value!r}")
    assert not found, found


def test_no_import_circle_between_models_and_tuning():
    # (builtins.py, which it reads builtin names through, imports neither)
    assert not [m for m in _imports(REPO / "specgate/gateway/serving/tuning.py")
                if m.startswith("specgate.gateway.") and m != "specgate.gateway.serving.builtins"]
    assert "specgate.gateway.serving.tuning" in _imports(REPO / "specgate/gateway/serving/models.py")  # the one direction



# ---------------------------------------------------------------- docs/DESIGN.md


def _design_engine_table() -> dict[str, dict[str, str]]:
    """docs/DESIGN.md's engine table (section "The engine registry"), by engine."""
    text = (REPO / "docs" / "DESIGN.md").read_text()
    section = text.split("## The engine registry", 1)[1].split("\n## ", 1)[0]
    rows = [line.strip().strip("|").split("|") for line in section.splitlines()
            if line.startswith("| `")]  # fmt: skip
    header = [h.strip() for h in section.split("| engine |", 1)[1].splitlines()[0].strip().strip("|").split("|")]
    header = ["engine", *header]
    return {row[0].strip().strip("`"): dict(zip(header, (c.strip() for c in row), strict=True))
            for row in rows}  # fmt: skip


def test_the_design_notes_engine_table_is_the_registry():
    table = _design_engine_table()
    assert list(table) == list(registry.names()), "DESIGN.md's engine table lists other engines"
    serves = {"mlx": "MLX dirs", "gguf": "GGUF"}
    for rec in registry.records():
        row = table[rec.name]
        assert row["method"] == rec.method, rec.name
        assert row["serves"] == serves[rec.format.name], rec.name
        assert row["settings"] == (rec.settings.__name__ if rec.settings.model_fields else "-"), rec.name


def test_the_design_table_check_sees_a_missing_engine(monkeypatch):
    text = (REPO / "docs" / "DESIGN.md").read_text()
    row = next(line for line in text.splitlines() if line.startswith("| `mlx_assistant` |"))
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: text.replace(row + "\n", ""))
    with pytest.raises(AssertionError, match="other engines"):
        test_the_design_notes_engine_table_is_the_registry()


def test_an_engine_setting_goes_from_yaml_to_the_proposer_as_it_is(tmp_path):
    """One per-engine option end to end: the model's YAML key, validated by
    the engine's settings class, reaches the proposer the engine makes."""
    from specgate.engines.base import GenerationRequest, Plan, SamplingParams
    from specgate.engines.settings import MTPNgramSettings
    from specgate.gateway.config import parse_config
    from specgate.gateway.serving.models import build_model_engines

    config = parse_config({"models": [{
        "id": "demo", "path": "builtin:demo", "engines": ["mlx_plain", "mlx_mtp_ngram"],
        "mlx_mtp_ngram": {"copy_match": 7, "mtp_depth": 3}}]})  # fmt: skip
    ctx, engines, refused = build_model_engines(config.models[0], config.llama_server,
                                                config.prefix_cache)  # fmt: skip
    assert not refused
    assert ctx.settings_of("mlx_mtp_ngram") == MTPNgramSettings(copy_match=7, mtp_depth=3)
    engine = engines["mlx_mtp_ngram"]
    request = GenerationRequest("r", "demo", [1, 2, 3], SamplingParams(), 8,
                                Plan(engine.name, engine.method, 8, "spec_on"))  # fmt: skip
    proposer = engine.make_decoder(request, None, 0).proposer
    assert (proposer.copy_match, proposer.mtp_depth) == (7, 3)
    # The class bounds it: a copy trusted on one matched token is refused.
    with pytest.raises(Exception, match="mlx_mtp_ngram.copy_match"):
        parse_config({"models": [{"id": "demo", "path": "builtin:demo",
                                  "engines": ["mlx_plain", "mlx_mtp_ngram"],
                                  "mlx_mtp_ngram": {"copy_match": 1}}]})  # fmt: skip
