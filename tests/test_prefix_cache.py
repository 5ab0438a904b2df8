"""The prefix cache (specgate/engines/cache/prefix_cache.py, specgate/engines/cache/prefix_disk.py), as a store.

Entries here hold real mlx-lm caches (KVCache; a hybrid's ArraysCache beside
one) filled with random arrays: what is checked is which entry serves which
prompt, to whom, what stays under the budget, and what a disk tier gives
back or refuses. tests/test_prefix_resume.py decodes through it.
"""

from __future__ import annotations

import logging

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache, KVCache

from specgate.engines.cache.prefix_cache import (
    SHARED,
    CacheBudget,
    DrafterState,
    PrefixCache,
    snapshot_points,
)
from specgate.engines.cache.prefix_disk import DiskTier

HYBRID = ("ArraysCache", "KVCache")


def kv(n: int, seed: int = 0) -> KVCache:
    c = KVCache()
    k = mx.random.normal((1, 2, n, 8), key=mx.random.key(seed))
    c.update_and_fetch(k, -k)
    return c


def hybrid(n: int, seed: int = 0) -> list:
    state = ArraysCache(2)
    state[0] = mx.random.normal((1, 3, 4), key=mx.random.key(seed + 1))
    state[1] = mx.full((1, 5), float(n))
    return [state, kv(n, seed)]


def store(trimmable: bool = True, **kw) -> PrefixCache:
    kw.setdefault("budget", CacheBudget(1 << 40))
    return PrefixCache("m", trimmable=trimmable, cache_classes=() if trimmable else HYBRID, **kw)


TOKENS = list(range(100, 300))


def test_a_prefix_entry_serves_longer_prompts_with_its_drafter_state():
    cache = store(trimmable=False)
    head = DrafterState([kv(49, 7)], {"h_prev": mx.ones((1, 1, 8))})
    cache.insert(TOKENS[:50], hybrid(50), "a", drafter="mtp", drafter_state=head)
    hit = cache.fetch(TOKENS, "a", "mtp")
    assert (hit.cached, hit.tier) == (50, "ram")
    assert mx.array_equal(hit.drafter.arrays["h_prev"], head.arrays["h_prev"])
    assert cache.fetch(TOKENS, "a", "dflash:x").drafter is None  # another drafter's: blind
    # A private copy: what the request does to it leaves the entry alone.
    hit.cache[1].trim(10)
    assert cache.fetch(TOKENS, "a").cache[1].offset == 50
    # A second drafter's state after the same tokens joins the entry, and counts.
    before, other = cache.nbytes, DrafterState([kv(49, 8)])
    cache.insert(TOKENS[:50], hybrid(50), "a", drafter="dflash:x", drafter_state=other)
    assert len(cache) == 1 and cache.nbytes == before + other.nbytes
    assert cache.fetch(TOKENS, "a", "dflash:x").drafter is not None


def test_a_hybrid_entry_is_never_cut_back():
    cache = store(trimmable=False)
    cache.insert(TOKENS[:50], hybrid(50), "a")
    assert cache.fetch(TOKENS[:50], "a").cache is None  # no token left to feed
    assert cache.fetch(TOKENS[:40], "a").cache is None  # its recurrent state is past 40
    diverging = TOKENS[:30] + [1, 2, 3] + TOKENS[33:]
    assert cache.fetch(diverging, "a").cache is None


def test_an_all_kv_entry_is_cut_back_to_what_is_shared_and_drops_drafter_state():
    cache = store()
    cache.insert(TOKENS[:50], [kv(50)], "a", drafter="mtp", drafter_state=DrafterState([kv(49)]))
    hit = cache.fetch(TOKENS[:50], "a", "mtp")  # the same prompt: its last token is fed again
    assert (hit.cached, hit.cache[0].offset, hit.drafter) == (49, 49, None)
    diverging = TOKENS[:30] + [1, 2, 3]
    hit = cache.fetch(diverging, "a")
    assert (hit.cached, hit.cache[0].offset) == (30, 30)


def test_scopes_share_a_system_prompt_whole_and_nothing_else():
    cache = store()
    system, secret = TOKENS[:40], TOKENS[:40] + [7, 7, 7, 7, 9, 9]
    cache.insert(system, [kv(40)], SHARED)
    cache.insert(secret, [kv(46)], "alice")
    # Bob, probing with alice's prompt and a guess at its next tokens, gets
    # the system prompt and not one token more: no match length to time.
    for probe in (secret, secret + [1], TOKENS[:40] + [7, 7, 1]):
        assert cache.fetch(probe, "bob").cached == 40
    assert cache.fetch(secret + [1], "alice").cached == 46
    # A shared entry is used whole only, even where its caches could be cut.
    assert cache.fetch(TOKENS[:30] + [5], "bob").cached == 0
    assert cache.fetch(TOKENS[:30] + [5], "alice").cached == 30  # alice's own entry, cut


def test_the_ram_budget_holds_across_models_under_50_long_prompts():
    budget = CacheBudget(0)
    a, b = store(budget=budget), store(budget=budget, trimmable=False)
    one = sum(c.nbytes for c in hybrid(1000))
    budget.max_bytes = 5 * one
    rng = np.random.default_rng(0)
    for i in range(50):
        prompt = rng.integers(0, 1 << 16, size=1000).tolist()
        (a if i % 2 else b).insert(prompt, [kv(1000, i)] if i % 2 else hybrid(1000, i), "k")
        assert a.nbytes + b.nbytes <= budget.max_bytes
        last = prompt
    assert 3 <= len(a) + len(b) <= 5
    assert a.stats.evictions + b.stats.evictions == 50 - len(a) - len(b)
    assert a.fetch(last + [1], "k").cached == 1000  # the newest stays
    budget.max_bytes = 0
    budget.enforce()
    assert len(a) == len(b) == 0


def test_entry_count_is_capped_per_model():
    cache = store(max_entries=3)
    for i in range(6):
        cache.insert([i] * 10 + [1], [kv(11, i)], "k")
    assert len(cache) == 3 and cache.stats.evictions == 3


def test_snapshot_points():
    # All-KV trunk: the system prompt's end (shared) and the prompt but its last token.
    assert snapshot_points(100, 0, (20, 60), 20, True, 32) == [20, 99]
    # Hybrid: also each message boundary and every `interval` tokens.
    assert snapshot_points(100, 0, (20, 60), 20, False, 32) == [20, 32, 60, 64, 96, 99]
    # Only past what the cache already served.
    assert snapshot_points(100, 60, (20, 60), 20, False, 32) == [64, 96, 99]
    assert snapshot_points(100, 99, (), 0, False, 0) == []


# -- the disk tier ---------------------------------------------------------------------


def disk_store(root, digest="d1", **kw) -> PrefixCache:
    disk = DiskTier(root, digest, 1 << 30, min_tokens=8, **kw)
    return store(trimmable=False, disk=disk)


def test_a_restart_reloads_entries_with_their_drafter_state(tmp_path):
    first = disk_store(tmp_path)
    trunk = hybrid(50, 3)
    head = DrafterState([kv(49, 4)], {"owed": mx.arange(6).reshape(1, 2, 3).astype(mx.bfloat16)})
    first.insert(TOKENS[:50], trunk, "a", drafter="dflash:abc", drafter_state=head)
    first.insert(TOKENS[:4], hybrid(4), "a")  # under min_tokens: RAM only
    first.disk.flush()
    assert len(first.disk) == 1

    again = disk_store(tmp_path)  # a new process's view of the same directory
    hit = again.fetch(TOKENS, "a", "dflash:abc")
    assert (hit.cached, hit.tier) == (50, "disk")
    assert again.stats.restores == 1
    for got, want in zip(hit.cache, trunk, strict=True):
        for g, w in zip(got.state, want.state, strict=False):
            if isinstance(w, mx.array):
                assert mx.array_equal(g, w)
    assert mx.array_equal(hit.drafter.caches[0].state[0], head.caches[0].state[0])
    assert hit.drafter.arrays["owed"].dtype == mx.bfloat16
    assert mx.array_equal(hit.drafter.arrays["owed"], head.arrays["owed"])
    # Now in RAM too: the next lookup does not read the disk again.
    assert again.fetch(TOKENS, "a").tier == "ram"
    assert again.fetch(TOKENS, "b").cached == 0  # scopes hold on disk as in RAM


def test_a_corrupted_entry_is_refused_and_deleted(tmp_path, caplog):
    first = disk_store(tmp_path)
    first.insert(TOKENS[:50], hybrid(50), "a")
    first.disk.flush()
    (path,) = first.disk.dir.glob("*.safetensors")
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40  # one bit of the last tensor's data
    path.write_bytes(bytes(data))
    again = disk_store(tmp_path)
    with caplog.at_level(logging.WARNING, logger="specgate.engines.cache.prefix_disk"):
        hit = again.fetch(TOKENS, "a")
    assert hit.cache is None and hit.cached == 0
    assert not path.exists() and again.disk.refused == 1
    assert "do not match its hash" in caplog.text


def test_cut_and_foreign_entries_are_refused(tmp_path):
    first = disk_store(tmp_path)
    first.insert(TOKENS[:50], hybrid(50), "a")
    first.disk.flush()
    (path,) = first.disk.dir.glob("*.safetensors")
    path.write_bytes(path.read_bytes()[:-100])  # a write cut short
    assert disk_store(tmp_path).fetch(TOKENS, "a").cached == 0
    assert not path.exists()

    # An entry of another model, copied into this model's directory.
    other = disk_store(tmp_path, digest="other")
    other.insert(TOKENS[:50], hybrid(50), "a")
    other.disk.flush()
    (foreign,) = other.disk.dir.glob("*.safetensors")
    moved = tmp_path / "d1" / foreign.name
    foreign.rename(moved)
    mine = disk_store(tmp_path)  # refused at the scan: its record names another model
    assert not moved.exists() and mine.disk.refused == 1
    assert mine.fetch(TOKENS, "a").cached == 0

    # The right model, but caches of another shape (another architecture's
    # entry with a forged record): refused at load.
    kv_only = disk_store(tmp_path, digest="kv")
    kv_only.insert(TOKENS[:50], [kv(50)], "a")
    kv_only.disk.flush()
    strict = PrefixCache("m", trimmable=False, cache_classes=HYBRID, budget=CacheBudget(1 << 40),
                         disk=DiskTier(tmp_path, "kv", 1 << 30, min_tokens=8))
    assert strict.fetch(TOKENS, "a").cached == 0 and strict.disk.refused == 1


def test_the_disk_budget_evicts_the_least_recently_used(tmp_path):
    cache = disk_store(tmp_path)
    one = None
    for i in range(4):
        cache.insert([i] * 50, hybrid(50, i), "a")
        cache.disk.flush()
        one = one or cache.disk.nbytes
    cache.disk.max_bytes = 2 * one
    cache.insert([9] * 50, hybrid(50, 9), "a")
    cache.disk.flush()
    assert cache.disk.nbytes <= 2 * one and cache.disk.evictions >= 3
    assert 9 in {int(r.tokens[0]) for r in cache.disk._index.values()}


def test_a_disk_that_cannot_be_written_leaves_ram_working(tmp_path, caplog):
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("")  # the tier's root is a file: every write fails
    cache = store(trimmable=False, disk=DiskTier(blocked, "d1", 1 << 30, min_tokens=8))
    with caplog.at_level(logging.WARNING, logger="specgate.engines.cache.prefix_disk"):
        cache.insert(TOKENS[:50], hybrid(50), "a")
        cache.disk.flush()
    assert "a disk write failed" in caplog.text
    assert cache.fetch(TOKENS, "a").cached == 50 and len(cache.disk) == 0
