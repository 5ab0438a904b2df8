"""A reasoning model's thinking: split from the answer, asked for, held to a budget, in three API shapes.

The pure parts are tested as plain functions: the streamed splitter
(gateway/api/thinking.ThinkingStream), the token-level budget
(engines/grammar/thinking.py), what each request maps to, the signature.
Then one gateway serves a reasoning model in Qwen3.x's thinking layout
(tests/thinker.py) and a model that cannot think, through the real openai
and anthropic SDKs, streamed and not; and a Qwen3.5 reasoning model with
an MTP head whose greedy and seeded outputs under MTP equal plain decoding's,
with the closing marker forced by the budget in both.
"""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest
from conftest import start_gateway, stop_gateway
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types.responses import (
    ResponseContentPartAddedEvent,
    ResponseReasoningItem,
    ResponseReasoningTextDeltaEvent,
    ResponseReasoningTextDoneEvent,
)
from thinker import ANSWER, THINKING_TEMPLATE, THOUGHT, build_thinker, build_thinking_mtp
from tokenizers import Tokenizer

from specgate.engines.base import ThinkingBudget, ThinkingFormat
from specgate.engines.grammar.thinking import Phase, ThinkingState, ThinkingTracker
from specgate.gateway.api import thinking
from specgate.gateway.api.thinking import (
    OutputStream,
    ThinkingAsk,
    ThinkingStream,
    Thought,
    plan_thinking,
)
from specgate.gateway.api.tools import ToolCall, ToolCallStream
from specgate.gateway.config import ThinkingConfig
from specgate.gateway.errors import APIError

START, END = 7, 9  # the markers' tokens in the pure tests
VOCAB = 16

# -- the text: thinking apart from the answer ------------------------------------------


def _split(text: str, opened: bool, cuts: list[int]) -> tuple[str, str]:
    stream, parts, at = ThinkingStream("<think>", "</think>", opened), [], 0
    for cut in sorted(cuts) + [len(text)]:
        parts += stream.feed(text[at:cut])
        at = max(at, cut)
    parts += stream.finish()
    return ("".join(p.text for p in parts if isinstance(p, Thought)),
            "".join(p for p in parts if isinstance(p, str)))  # fmt: skip


SAMPLES = [
    # (output, prompt opened the thinking, thinking, answer)
    (
        "Let me see.\n\nYes.\n</think>\n\nIt is <b>4</b>.",
        True,
        "Let me see.\n\nYes.",
        "It is <b>4</b>.",
    ),
    ("<think>\nhmm</think>\n\nHi", False, "hmm", "Hi"),
    ("  <think>hmm</think>Hi", False, "hmm", "Hi"),
    ("No thinking here. <think> is just text", False, "", "No thinking here. <think> is just text"),
    ("<thi", False, "", "<thi"),  # a marker's start that never completes is text
    ("cut short in thought \n", True, "cut short in thought", ""),  # max_tokens inside thinking
    ("\n\n</think>\n\nAnswer", True, "", "Answer"),  # an empty thinking
    ("a </thin", True, "a </thin", ""),
]


@pytest.mark.parametrize("text, opened, thought, answer", SAMPLES)
def test_thinking_is_split_from_the_answer(text, opened, thought, answer):
    assert _split(text, opened, []) == (thought, answer)
    for cut in range(len(text) + 1):  # every single cut, and token by token
        assert _split(text, opened, [cut]) == (thought, answer)
    assert _split(text, opened, list(range(len(text)))) == (thought, answer)


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_any_cutting_gives_the_same_split(data):
    text, opened, thought, answer = data.draw(st.sampled_from(SAMPLES))
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=6))
    assert _split(text, opened, cuts) == (thought, answer)


def test_the_answer_goes_to_the_tool_call_parser():
    counting = ThinkingBudget((START,), (END,), True, None, "<think>", "</think>")
    tools = ToolCallStream("hermes", [])
    stream = OutputStream(counting, tools)
    text = ('I will call it.</think>\n\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n'
            "</tool_call>")  # fmt: skip
    events = (
        stream.feed(text[:20], [1, 2, 3, END, 4]) + stream.feed(text[20:], [5]) + stream.finish()
    )
    assert events == [Thought("I will call it."), ToolCall("f", {"x": 1})]
    assert stream.reasoning_tokens == 4  # the thinking and its closing marker


# -- the tokens: a budget held by masks -------------------------------------------------


def _spec(budget, opened=True, start=(START,), end=(END,)) -> ThinkingBudget:
    return ThinkingBudget(start, end, opened, budget)


def _decode(state: ThinkingState, wants: list[int]) -> list[int]:
    """What a decoder commits where it would pick `wants`, one by one, under the masks."""
    out = []
    for want in wants:
        mask = state.allowed()
        token = want if mask is None or mask[want] else int(mask.argmax())
        state.advance([token])
        out.append(token)
    return out


def test_the_closing_marker_is_forced_when_the_budget_is_spent():
    state = ThinkingState(_spec(3), None, VOCAB)
    assert _decode(state, [1, 2, 3, 4, 5, 6]) == [1, 2, 3, END, 5, 6]
    assert state.tracker.phase is Phase.ANSWER and state.allowed() is None
    # A thinking that closes within its budget is left alone.
    assert _decode(ThinkingState(_spec(3), None, VOCAB), [1, END, 4, 5]) == [1, END, 4, 5]
    # Budget 0 (thinking off on a template that cannot switch): closed at once.
    assert _decode(ThinkingState(_spec(0), None, VOCAB), [1, 2]) == [END, 2]
    # No budget: nothing forced, however long.
    assert _decode(ThinkingState(_spec(None), None, VOCAB), [1] * 50) == [1] * 50


def test_markers_of_several_tokens_are_forced_in_order():
    spec = _spec(2, opened=False, start=(START, 8), end=(END, 10, 11))
    # The output opens its own thinking with the marker's first token: the
    # rest is forced; after two thinking tokens the closing marker, in order.
    assert _decode(ThinkingState(spec, None, VOCAB), [START, 1, 2, 3, 4, 5, 6, 12]) == [
        START, 8, 2, 3, END, 10, 11, 12]  # fmt: skip
    # A closing marker already begun when the budget runs out is completed.
    assert _decode(ThinkingState(_spec(2, end=(END, 10)), None, VOCAB), [1, END, 3, 4]) == [
        1, END, 10, 4]  # fmt: skip
    # An output that does not open thinking is the answer from its first token.
    state = ThinkingState(spec, None, VOCAB)
    assert _decode(state, [3, START, 1]) == [3, START, 1] and state.tracker.phase is Phase.ANSWER


def test_speculation_sees_the_same_masks():
    """Drafts pushed and taken back, verify masks along drafts, the valid
    prefix of drafts that come alone: all agree with committing one by one."""
    state = ThinkingState(_spec(3), None, VOCAB)
    state.advance([1])
    assert not state.quiet(3) and state.quiet(2)  # the closing marker is 3 positions away
    rows = state.masks_along([2, 3, END, 5])  # (drafts cut to their valid prefix first)
    assert [None if r is None else int(r.argmax()) for r in rows] == [None, None, END, None, None]
    assert state.tracker.thinking_tokens == 1  # left where it was
    assert state.valid_prefix([2, 3, 4]) == 2 and state.valid_prefix([2, 3, END, 6]) == 4
    state.draft(2)
    state.draft(3)
    assert int(state.allowed().argmax()) == END  # a drafter's next draw is masked too
    state.undo_drafts()
    assert state.tracker.thinking_tokens == 1 and state.allowed() is None
    assert _decode(state, [2, 3, 4]) == [2, 3, END]
    assert ThinkingState(_spec(None), None, VOCAB).quiet(64)


def test_tracker_counts_what_usage_reports():
    tracker = ThinkingTracker(_spec(None, opened=False))
    for t in [START, 1, 2, END, 3, 4]:
        tracker.feed(t)
    # Spent: everything before the answer; counted: the closing marker's token too.
    assert tracker.spent == 4 and tracker.thinking_tokens == 3


# -- requests to think ----------------------------------------------------------------


QWEN = ThinkingFormat("<think>", "</think>", (START,), (END,), switchable=True)
ALWAYS = ThinkingFormat("<think>", "</think>", (START,), (END,), switchable=False)
LLAMA = ThinkingFormat("<think>", "</think>", (START,), (END,), switchable=True,
                       grammar_after_thinking=False)  # fmt: skip
OPENED, CLOSED = [1, 2, START], [1, START, 3, END, 3]


def test_efforts_and_switches():
    cfg = ThinkingConfig(low=3, medium=30, high=None, default=100)
    assert thinking.from_effort("low", cfg) == ThinkingAsk(True, 3)
    assert thinking.from_effort("high", cfg) == ThinkingAsk(True, None)
    assert (
        thinking.from_effort("minimal", cfg)
        == thinking.from_effort("none", cfg)
        == ThinkingAsk(False)
    )
    assert thinking.from_effort(None, cfg) == ThinkingAsk()
    assert thinking.from_switch(True, cfg) == ThinkingAsk(True, 100)
    assert thinking.either(ThinkingAsk(True, 30), ThinkingAsk(True, 100), "p") == ThinkingAsk(
        True, 30
    )
    assert thinking.either(ThinkingAsk(), ThinkingAsk(False), "p") == ThinkingAsk(False)
    with pytest.raises(APIError, match="opposite"):
        thinking.either(ThinkingAsk(False), ThinkingAsk(True), "reasoning_effort")


def test_what_the_template_and_the_engines_get():
    # Unsaid: the template's default, nothing held without a grammar.
    p = plan_thinking(QWEN, ThinkingAsk(), grammar=False)
    assert p.template_kwargs is None and p.held(p.counting(OPENED)) is None
    # A budget: the switch on, the budget held.
    p = plan_thinking(QWEN, ThinkingAsk(True, 5), grammar=False)
    assert p.template_kwargs == {"enable_thinking": True}
    assert p.held(p.counting(OPENED)) == ThinkingBudget(
        (START,), (END,), True, 5, "<think>", "</think>"
    )
    # Off: the template switches it off, and nothing is held.
    p = plan_thinking(QWEN, ThinkingAsk(False), grammar=True)
    assert p.template_kwargs == {"enable_thinking": False} and p.held(p.counting(CLOSED)) is None
    # A grammar: held, to start after the thinking.
    p = plan_thinking(QWEN, ThinkingAsk(True), grammar=True)
    assert p.held(p.counting(OPENED)).budget is None
    # Off on a template without the switch: a budget of 0.
    p = plan_thinking(ALWAYS, ThinkingAsk(False), grammar=False)
    assert p.template_kwargs is None and p.held(p.counting(OPENED)).budget == 0
    # llama-server holds a grammar over the whole output: thinking off then.
    p = plan_thinking(LLAMA, ThinkingAsk(True), grammar=True)
    assert p.template_kwargs == {"enable_thinking": False}
    # A model that does not think: nothing at all.
    p = plan_thinking(None, ThinkingAsk(True, 5), grammar=True)
    assert p.template_kwargs is None and p.counting(OPENED) is None


def test_which_models_think(models):
    """mlx-lm's markers, where the template writes them: a family's
    non-thinking models share its vocabulary."""
    from mlx_lm.utils import load_tokenizer

    from specgate.builders.tokenizer import CHAT_TEMPLATE
    from specgate.engines.worker import thinking_format

    tok = load_tokenizer(models["thinker"])
    form = thinking_format(tok, THINKING_TEMPLATE)
    assert (form.start, form.end, form.switchable) == ("<think>", "</think>", True)
    assert form.start_tokens == (tok.convert_tokens_to_ids("<think>"),)
    assert thinking_format(tok, CHAT_TEMPLATE) is None


def test_signatures(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECGATE_HOME", str(tmp_path))
    signature = thinking.sign("a thought")
    assert thinking.verify("a thought", signature)
    assert not thinking.verify("another thought", signature)
    assert not thinking.verify("a thought", None) and not thinking.verify("a thought", "sg1.x")
    assert (tmp_path / "thinking.key").stat().st_mode & 0o077 == 0  # the owner's only


# -- three API shapes, one model ----------------------------------------------------------

LOW = 3  # the thinker's budget for reasoning_effort "low"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("thinkers")
    return {"thinker": build_thinker(root / "thinker"), "mtp": build_thinking_mtp(root / "mtp")}


@pytest.fixture(scope="module")
def gw(models, tiny_model, tmp_path_factory):
    g = start_gateway({"models": [
        {"id": "thinker", "path": str(models["thinker"]), "max_context": 2048,
         "thinking": {"low": LOW}},
        {"id": "thinker-mtp", "path": str(models["mtp"]), "max_context": 2048,
         "engines": ["mlx_plain", "mlx_mtp"], "mlx_mtp": {"depth": 3}, "thinking": {"low": 5}},
        {"id": "plain", "path": str(tiny_model), "max_context": 2048},
    ]}, tmp_path_factory.mktemp("thinking-gateway"))  # fmt: skip
    yield g
    stop_gateway(g)


@pytest.fixture(scope="module")
def oai(gw):
    return openai.OpenAI(base_url=gw.api, api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def ant(gw):
    return anthropic.Anthropic(base_url=gw.base_url, api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def think_end(models) -> int:
    return Tokenizer.from_file(str(models["thinker"] / "tokenizer.json")).token_to_id("</think>")


ASK = [{"role": "user", "content": "What is 2+2?"}]


def test_openai_chat_reasoning_content(oai):
    r = oai.chat.completions.create(model="thinker", messages=ASK, temperature=0, max_tokens=40)
    msg = r.choices[0].message
    assert msg.reasoning_content == THOUGHT and msg.content == ANSWER
    assert r.choices[0].finish_reason == "stop"
    reasoning = r.usage.completion_tokens_details.reasoning_tokens
    assert 0 < reasoning < r.usage.completion_tokens
    chunks = list(oai.chat.completions.create(model="thinker", messages=ASK, temperature=0,
                                              max_tokens=40, stream=True,
                                              stream_options={"include_usage": True}))  # fmt: skip
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == THOUGHT
    assert "".join(d.content or "" for d in deltas) == ANSWER
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == reasoning


def test_responses_reasoning_item(oai):
    r = oai.responses.create(model="thinker", input="What is 2+2?", temperature=0,
                             max_output_tokens=40)  # fmt: skip
    reasoning, message = r.output
    assert isinstance(reasoning, ResponseReasoningItem) and reasoning.summary == []
    assert reasoning.content[0].type == "reasoning_text" and reasoning.content[0].text == THOUGHT
    assert message.type == "message" and message.content[0].text == ANSWER
    assert r.output_text == ANSWER and r.usage.output_tokens_details.reasoning_tokens > 0
    events = list(oai.responses.create(model="thinker", input="What is 2+2?", temperature=0,
                                       max_output_tokens=40, stream=True))  # fmt: skip
    # The SDK parsed each event into its own type.
    deltas = [e for e in events if isinstance(e, ResponseReasoningTextDeltaEvent)]
    assert "".join(e.delta for e in deltas) == THOUGHT
    (done,) = [e for e in events if isinstance(e, ResponseReasoningTextDoneEvent)]
    assert done.text == THOUGHT and done.output_index == 0
    parts = [e.part.type for e in events if isinstance(e, ResponseContentPartAddedEvent)]
    assert parts == ["reasoning_text", "output_text"]
    final = events[-1].response
    assert final.output[0].content[0].text == THOUGHT and final.output_text == ANSWER


def test_ollama_thinking_field(gw):
    """Ollama's API gives the same generation's thinking as `message.thinking`
    (`thinking` on /api/generate), streamed and not, in the ollama client's own
    types; `think: false` turns it off, an effort holds it to its budget."""
    import ollama

    client = ollama.Client(host=gw.base_url, timeout=60)
    opts = {"temperature": 0, "num_predict": 40}
    r = client.chat(model="thinker", messages=ASK, options=opts)
    assert r.message.thinking == THOUGHT and r.message.content == ANSWER
    parts = list(client.chat(model="thinker", messages=ASK, options=opts, stream=True))
    assert "".join(p.message.thinking or "" for p in parts) == THOUGHT
    assert "".join(p.message.content for p in parts) == ANSWER
    g = client.generate(model="thinker", prompt="What is 2+2?", options=opts, think=True)
    assert g.thinking == THOUGHT and g.response == ANSWER
    off = client.chat(model="thinker", messages=ASK, options=opts, think=False)
    assert not off.message.thinking and off.message.content == ANSWER
    low = client.chat(model="thinker", messages=ASK, options=opts, think="low")
    assert THOUGHT.startswith(low.message.thinking) and low.message.thinking != THOUGHT
    assert low.message.content == ANSWER


def test_anthropic_thinking_block(ant, gw):
    kw = dict(model="thinker", max_tokens=40, messages=ASK, thinking={"type": "adaptive"},
              extra_body={"temperature": 0})  # fmt: skip
    msg = ant.messages.create(**kw)
    block, text = msg.content
    assert block.type == "thinking" and block.thinking == THOUGHT and block.signature
    assert text.type == "text" and text.text == ANSWER and msg.stop_reason == "end_turn"
    with ant.messages.stream(**kw) as stream:
        kinds = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert kinds[0] == "thinking_delta" and "signature_delta" in kinds
    assert final.content[0].thinking == THOUGHT and final.content[0].signature == block.signature
    assert final.content[1].text == ANSWER

    # Sent back in a tool loop, the signed thinking is the turn's own again (the
    # template shows the thinking of the turn in progress); a block whose
    # signature is not this server's is left out, and the request still served.
    def count(signature: str) -> int:
        history = [*ASK,
                   {"role": "assistant", "content": [
                       {"type": "thinking", "thinking": THOUGHT, "signature": signature},
                       {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 2}}]},
                   {"role": "user", "content": [
                       {"type": "tool_result", "tool_use_id": "toolu_1", "content": "4"}]}]  # fmt: skip
        tools = [{"name": "add", "input_schema": {"type": "object"}}]
        ant.messages.create(model="thinker", max_tokens=4, messages=history, tools=tools)
        return ant.messages.count_tokens(
            model="thinker", messages=history, tools=tools
        ).input_tokens

    assert count(block.signature) > count("sg1.forged")


def test_thinking_off_gives_no_thinking(oai, ant):
    for extra in (
        {"reasoning_effort": "none"},
        {"chat_template_kwargs": {"enable_thinking": False}},
    ):
        r = oai.chat.completions.create(model="thinker", messages=ASK, temperature=0,
                                        max_tokens=40, extra_body=extra)  # fmt: skip
        msg = r.choices[0].message
        assert getattr(msg, "reasoning_content", None) is None and msg.content == ANSWER
        assert r.usage.completion_tokens_details.reasoning_tokens == 0
    msg = ant.messages.create(
        model="thinker",
        max_tokens=40,
        messages=ASK,
        thinking={"type": "disabled"},
        extra_body={"temperature": 0},
    )
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == ANSWER
    r = oai.responses.create(model="thinker", input="What is 2+2?", temperature=0,
                             max_output_tokens=40, reasoning={"effort": "minimal"})  # fmt: skip
    assert [i.type for i in r.output] == ["message"] and r.output_text == ANSWER
    with pytest.raises(openai.BadRequestError, match="opposite"):
        oai.chat.completions.create(
            model="thinker",
            messages=ASK,
            max_tokens=4,
            extra_body={
                "reasoning_effort": "high",
                "chat_template_kwargs": {"enable_thinking": False},
            },
        )


def test_the_budget_is_respected(oai, ant, think_end):
    r = oai.chat.completions.create(
        model="thinker",
        messages=ASK,
        temperature=0,
        max_tokens=40,
        extra_body={"reasoning_effort": "low", "return_token_ids": True},
    )
    ids = r.choices[0].token_ids
    assert ids.index(think_end) == LOW  # forced right after the budget's tokens
    msg = r.choices[0].message
    assert THOUGHT.startswith(msg.reasoning_content) and msg.reasoning_content != THOUGHT
    assert msg.content == ANSWER  # the answer follows the forced marker
    assert r.usage.completion_tokens_details.reasoning_tokens == LOW + 1
    msg = ant.messages.create(model="thinker", max_tokens=40, messages=ASK,
                              thinking={"type": "enabled", "budget_tokens": 2},
                              extra_body={"temperature": 0})  # fmt: skip
    assert len(msg.content[0].thinking) < len(THOUGHT) and msg.content[1].text == ANSWER
    # A thinking cut by max_tokens is still thinking, and says so.
    r = oai.chat.completions.create(model="thinker", messages=ASK, temperature=0, max_tokens=2)
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].message.reasoning_content and not r.choices[0].message.content


def test_a_grammar_holds_the_answer_after_free_thinking(oai):
    schema = {"type": "object", "properties": {"a": {"enum": ["x"]}}, "required": ["a"],
              "additionalProperties": False}  # fmt: skip
    r = oai.chat.completions.create(
        model="thinker",
        messages=ASK,
        temperature=0,
        max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
    )
    assert r.choices[0].message.reasoning_content == THOUGHT
    assert r.choices[0].message.content == '{"a": "x"}'


def test_a_model_that_cannot_think_just_answers(oai, ant):
    r = oai.chat.completions.create(model="plain", messages=ASK, max_tokens=4,
                                    extra_body={"reasoning_effort": "high"})  # fmt: skip
    assert getattr(r.choices[0].message, "reasoning_content", None) is None
    msg = ant.messages.create(model="plain", max_tokens=4, messages=ASK,
                              thinking={"type": "enabled", "budget_tokens": 1024})  # fmt: skip
    assert msg.content[0].type == "text"
    r = oai.responses.create(model="plain", input="hi", max_output_tokens=4,
                             reasoning={"effort": "high"})  # fmt: skip
    assert r.output[0].type == "message"


# -- under MTP -----------------------------------------------------------------------------


def _ids(oai, method: str, **kw) -> tuple[list[int], str]:
    raw = oai.chat.completions.with_raw_response.create(
        model="thinker-mtp",
        messages=ASK,
        max_tokens=24,
        extra_headers={"X-Specgate-Method": method},
        extra_body={"reasoning_effort": "low", "return_token_ids": True},
        **kw,
    )
    return raw.parse().choices[0].token_ids, raw.headers["x-specgate-plan"]


def test_mtp_equals_plain_with_the_budget(oai, think_end):
    greedy, plan = _ids(oai, "mtp", temperature=0)
    assert plan.startswith("method=mtp")
    assert greedy == _ids(oai, "none", temperature=0)[0]
    assert think_end in greedy[:6]  # forced at the budget, 5 (if not written earlier)
    seeded = _ids(oai, "mtp", temperature=0.8, seed=7)[0]
    assert seeded == _ids(oai, "none", temperature=0.8, seed=7)[0] and think_end in seeded[:6]
    # With a grammar after the thinking: drafts pass the budget, then the grammar.
    json = {"response_format": {"type": "json_object"}}
    held = _ids(oai, "mtp", temperature=0, **json)[0]
    assert held == _ids(oai, "none", temperature=0, **json)[0] and think_end in held[:6]
    # The same thinking in every shape, under MTP.
    msg = (
        oai.chat.completions.create(
            model="thinker-mtp",
            messages=ASK,
            max_tokens=24,
            temperature=0,
            extra_headers={"X-Specgate-Method": "mtp"},
            extra_body={"reasoning_effort": "low"},
        )
        .choices[0]
        .message
    )
    assert msg.reasoning_content
    ant = anthropic.Anthropic(base_url=str(oai.base_url).removesuffix("/v1/"), api_key="none",
                              max_retries=0)  # fmt: skip
    block = ant.messages.create(
        model="thinker-mtp",
        max_tokens=24,
        messages=ASK,
        thinking={"type": "enabled", "budget_tokens": 5},
        extra_body={"temperature": 0},
        extra_headers={"X-Specgate-Method": "mtp"},
    ).content[0]
    assert block.type == "thinking" and block.thinking == msg.reasoning_content
    r = oai.responses.create(
        model="thinker-mtp",
        input=ASK,
        max_output_tokens=24,
        temperature=0,
        reasoning={"effort": "low"},
        extra_headers={"X-Specgate-Method": "mtp"},
    )
    assert r.output[0].content[0].text == msg.reasoning_content


def test_unknown_template_variables_are_not_refused(gw):
    r = httpx.post(gw.api + "/chat/completions", json={
        "model": "thinker", "messages": ASK, "max_tokens": 4,
        "chat_template_kwargs": {"enable_thinking": True, "custom": "x"}}, timeout=60)  # fmt: skip
    assert r.status_code == 200, r.text
    r = httpx.post(gw.api + "/chat/completions", json={
        "model": "thinker", "messages": ASK, "max_tokens": 4,
        "chat_template_kwargs": {"enable_thinking": "yes"}}, timeout=60)  # fmt: skip
    assert r.status_code == 400 and "enable_thinking" in r.json()["error"]["message"]


# -- through llama-server -----------------------------------------------------------------


@pytest.fixture(scope="module")
def gguf_gw(models, llama_server_binary, tmp_path_factory):
    from specgate.builders.gguf_export import export_gguf

    gguf = export_gguf(models["mtp"], tmp_path_factory.mktemp("gguf") / "thinker-mtp.gguf")
    model = {"id": "g", "path": str(gguf), "max_context": 512, "engines": ["llamacpp", "llamacpp_mtp"],
             "llamacpp_mtp": {"depth": 3}, "thinking": {"low": 5}, "llamacpp": {"threads": 1}}  # fmt: skip
    g = start_gateway(
        {"llama_server": {"binary": str(llama_server_binary)}, "models": [model]},
        tmp_path_factory.mktemp("thinking-gguf"),
    )
    yield g
    stop_gateway(g)


def test_llama_server_holds_the_budget_and_switches_thinking_off_under_a_grammar(
    gguf_gw, think_end
):
    """llama-server's own budget sampler, given the markers and the prompt's
    opening one: the same count as the MLX engines'."""
    oai = openai.OpenAI(base_url=gguf_gw.api, api_key="none", max_retries=0, timeout=120)
    for method in ("none", "mtp"):
        raw = oai.chat.completions.with_raw_response.create(
            model="g", messages=ASK, max_tokens=16, temperature=0,
            extra_headers={"X-Specgate-Method": method},
            extra_body={"reasoning_effort": "low", "return_token_ids": True})  # fmt: skip
        r = raw.parse()
        assert raw.headers["x-specgate-plan"].startswith(
            f"method={'llamacpp_mtp' if method == 'mtp' else 'none'}"
        )
        ids = r.choices[0].token_ids
        assert think_end in ids[:6], ids
        assert r.choices[0].message.reasoning_content
        assert r.usage.completion_tokens_details.reasoning_tokens == ids.index(think_end) + 1
    # A grammar holds llama-server's whole output: the prompt has thinking off.
    r = oai.chat.completions.create(model="g", messages=ASK, max_tokens=16, temperature=0,
                                    response_format={"type": "json_object"},
                                    extra_body={"reasoning_effort": "low"})  # fmt: skip
    assert getattr(r.choices[0].message, "reasoning_content", None) is None
    assert r.choices[0].message.content.startswith("{")
