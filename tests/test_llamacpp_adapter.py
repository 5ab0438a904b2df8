"""The llama-server translation, tested directly (pure functions, no server)."""

import random

import pytest

from specgate.engines.base import GenerationRequest, Plan, PrefillProgress, SamplingParams
from specgate.engines.llamacpp.adapter import (
    SAMPLER_ORDER,
    SpecCounters,
    completion_body,
    parse_spec_counters,
    read_chunk,
    read_progress,
    refusal,
    rounds_from_counters,
)

PLAN = Plan("llamacpp_mtp", "llamacpp_mtp", 3, "spec_on")
GREEDY = SamplingParams(temperature=0.0)


def request(sampling=GREEDY, stops=frozenset({9}), prompt=(1, 2, 3)):
    return GenerationRequest("r", "m", list(prompt), sampling, 16, PLAN, stops)


def test_body_sends_every_sampler_in_specgates_order():
    s = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, seed=7,
                       repetition_penalty=1.1)
    body = completion_body(request(s))
    assert body["samplers"] == list(SAMPLER_ORDER)
    assert SAMPLER_ORDER.index("temperature") < SAMPLER_ORDER.index("top_p")  # not llama.cpp's default
    assert (body["temperature"], body["top_p"], body["top_k"], body["min_p"]) == (0.7, 0.9, 20, 0.05)
    assert body["repeat_penalty"] == 1.1 and body["repeat_last_n"] == 3 + 16  # prompt + output
    assert body["prompt"] == [1, 2, 3] and body["n_predict"] == 16 and body["seed"] == 7
    assert body["stream"] and body["return_tokens"] and not body["ignore_eos"]
    assert "n_probs" not in body


def test_only_requests_that_ask_for_determinism_skip_the_prompt_cache():
    # Greedy or seeded: evaluated cold, so the cache's state cannot change the text
    # (tests/test_llamacpp_exact.py shows it does otherwise).
    assert completion_body(request(GREEDY))["cache_prompt"] is False
    assert completion_body(request(SamplingParams(temperature=0.7, seed=1)))["cache_prompt"] is False
    assert completion_body(request(SamplingParams(temperature=0.7)))["cache_prompt"] is True
    # A model's `llamacpp: {reproducible: false}` keeps the cache for them (aider
    # sends temperature 0 every turn: a re-sent prefix stays cached).
    assert completion_body(request(GREEDY), reproducible=False)["cache_prompt"] is True


def test_body_neutralises_llama_server_defaults():
    body = completion_body(request(SamplingParams()))
    # llama-server's own defaults are top_k 40, top_p 0.95, min_p 0.05: all sent as "off".
    assert (body["top_k"], body["top_p"], body["min_p"]) == (0, 1.0, 0.0)
    assert body["dry_multiplier"] == 0 and body["xtc_probability"] == 0 and body["mirostat"] == 0
    assert body["seed"] == -1  # unseeded: llama.cpp draws a random seed


def test_body_ignore_eos_and_logprobs():
    assert completion_body(request(stops=frozenset()))["ignore_eos"] is True
    assert completion_body(request(SamplingParams(logprobs=True)))["n_probs"] == 1
    assert completion_body(request(SamplingParams(logprobs=True, top_logprobs=5)))["n_probs"] == 5
    assert 0 <= completion_body(request(SamplingParams(seed=2**40 + 3)))["seed"] < 2**31


@pytest.mark.parametrize("sampling,speculative,reason,param", [
    (SamplingParams(presence_penalty=0.5), False, "penalties", "presence_penalty"),
    (SamplingParams(frequency_penalty=-0.2), True, "penalties", "frequency_penalty"),
    (SamplingParams(logprobs=True), True, "unsupported_params", "logprobs"),
    (SamplingParams(logprobs=True, repetition_penalty=1.2), False, "penalties", "logprobs"),
])
def test_refuses_what_it_cannot_serve_exactly(sampling, speculative, reason, param):
    r = refusal(sampling, speculative)
    assert r is not None and (r.reason, r.param) == (reason, param)


@pytest.mark.parametrize("sampling,speculative", [
    (SamplingParams(), True),
    (SamplingParams(repetition_penalty=1.3, temperature=0.5, top_k=3), True),
    (SamplingParams(logprobs=True, top_logprobs=3), False),
])
def test_serves_the_rest(sampling, speculative):
    assert refusal(sampling, speculative) is None


def test_chunk_translation():
    req = request()
    got = read_chunk({"content": "ab", "tokens": [4, 5], "stop": False}, req)
    assert (got.token_ids, got.text, got.finish_reason) == ([4, 5], "ab", None)
    end = read_chunk({"content": "", "tokens": [], "stop": True, "stop_type": "limit",
                      "timings": {"cache_n": 12}}, req)
    assert (end.finish_reason, end.cached_tokens) == ("length", 12)
    assert read_chunk({"tokens": [], "stop": True, "stop_type": "eos"}, req).finish_reason == "stop"


def test_prompt_progress_events_are_progress_not_output():
    # Asked for, so a long prefill shows progress; as llama-server b11312 sends
    # them, with a placeholder token 0 that is no output.
    assert completion_body(request())["return_progress"] is True

    def chunk(processed: int) -> dict:
        return {"content": "", "tokens": [0], "stop": False,
                "prompt_progress": {"total": 900, "cache": 100, "processed": processed,
                                    "time_ms": 40}}  # fmt: skip

    assert read_progress(chunk(100)) is None  # nothing evaluated yet
    assert read_progress(chunk(612)) == PrefillProgress(612, 900, 100)
    assert read_progress(chunk(900)) is None  # the last batch: the first token follows
    assert read_progress({"content": "x", "tokens": [4]}) is None
    assert read_progress({"prompt_progress": {"total": "many"}}) is None


def test_stop_token_ends_and_is_not_output():
    req = request(stops=frozenset({9}))
    got = read_chunk({"content": "x", "tokens": [4, 9, 6], "stop": False}, req)
    assert (got.token_ids, got.finish_reason) == ([4], "stop")
    got = read_chunk({"content": "<|im_end|>", "tokens": [9], "stop": True, "stop_type": "eos"}, req)
    assert (got.token_ids, got.text, got.finish_reason) == ([], "", "stop")


def test_logprobs_translation():
    req = request(SamplingParams(temperature=0.0, logprobs=True, top_logprobs=1))
    probs = [{"id": 4, "token": " a", "logprob": -0.5,
              "top_logprobs": [{"id": 4, "token": " a", "logprob": -0.5},
                               {"id": 8, "token": " b", "logprob": -1.5}]}]
    got = read_chunk({"content": " a", "tokens": [4], "completion_probabilities": probs}, req)
    (lp,) = got.logprobs
    assert (lp.token_id, lp.text, lp.logprob) == (4, " a", -0.5)
    assert [(t.token_id, t.logprob) for t in lp.top] == [(4, -0.5)]  # cut to top_logprobs


METRICS_TEXT = """\
# HELP llamacpp:spec_decode_num_drafts_total Speculative: Total speculative decoding verification steps
# TYPE llamacpp:spec_decode_num_drafts_total counter
llamacpp:spec_decode_num_drafts_total 3
# TYPE llamacpp:spec_decode_num_draft_tokens_total counter
llamacpp:spec_decode_num_draft_tokens_total 9
# TYPE llamacpp:spec_decode_num_accepted_tokens_total counter
llamacpp:spec_decode_num_accepted_tokens_total 8
# TYPE llamacpp:spec_decode_num_accepted_tokens_per_pos_total counter
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 3
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 3
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="2"} 2
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 0
"""


def test_parse_counters_as_llama_server_writes_them():
    assert parse_spec_counters(METRICS_TEXT) == SpecCounters(3, 9, 8, (3, 3, 2))
    assert parse_spec_counters("") == SpecCounters()


def test_counter_deltas_and_restarts():
    a, b = SpecCounters(3, 9, 8, (3, 3, 2)), SpecCounters(5, 15, 10, (5, 3, 2, 0))
    assert b.minus(a) == SpecCounters(2, 6, 2, (2, 0, 0, 0))
    assert a.minus(b) == a  # counters went down: the server restarted, count from zero


def test_rounds_rebuild_the_counters_exactly():
    rng = random.Random(0)
    for _ in range(300):
        n_max, drafts = rng.randint(1, 6), rng.randint(0, 40)
        lengths = [rng.randint(1, n_max) for _ in range(drafts)]  # tokens drafted per round
        ok = [rng.randint(0, n) for n in lengths]  # accepted prefix per round
        per_pos = tuple(sum(1 for a in ok if a > i) for i in range(n_max))
        c = SpecCounters(drafts, sum(lengths), sum(ok), per_pos)
        rounds = rounds_from_counters("m", "llamacpp_ngram", c)
        assert len(rounds) == drafts
        assert sum(r.drafted for r in rounds) == c.draft_tokens
        assert sum(r.accepted for r in rounds) == c.accepted
        for i in range(n_max):
            assert sum(1 for r in rounds if len(r.accepted_per_position) > i
                       and r.accepted_per_position[i]) == per_pos[i]
        for r in rounds:  # acceptance is a prefix, drafted covers it
            flags = r.accepted_per_position
            assert flags == sorted(flags, reverse=True) and len(flags) == r.drafted
            assert r.method == "llamacpp_ngram" and r.verify_width == r.drafted + 1
