from specgate.gateway.serving.stops import StopMatcher


def feed_all(stops, pieces):
    m = StopMatcher(stops)
    out = "".join(m.feed(p) for p in pieces)
    if not m.stopped:
        out += m.flush()
    return out, m.stopped


def test_no_stops_passes_through():
    assert feed_all([], ["ab", "c"]) == ("abc", False)


def test_stop_split_across_pieces():
    assert feed_all(["END"], ["hello E", "N", "D and more"]) == ("hello ", True)


def test_false_start_is_released():
    m = StopMatcher(["END"])
    assert m.feed("hello EN") == "hello "  # "EN" might start "END": held
    assert m.feed("X") == "ENX"
    assert not m.stopped


def test_earliest_of_several_stops_wins():
    assert feed_all(["world", "lo w"], ["hello world"]) == ("hel", True)
    m = StopMatcher(["world", "lo w"])
    m.feed("hello world")
    assert m.matched == "lo w"  # named, for Anthropic's stop_sequence


def test_held_text_flushed_at_end():
    assert feed_all(["STOP"], ["abc ST"]) == ("abc ST", False)
