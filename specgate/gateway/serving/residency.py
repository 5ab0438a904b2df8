"""Which models stay loaded: pure decisions on plain records, tested
directly; gateway/serving/models.py carries them out.

Rules:
- a model that needs loading fits in what the budget leaves, or the least
  recently used idle models make room, oldest first, no more than needed;
- pinned models are never evicted, nor models with requests in flight
  (those are waited for: they go idle by themselves);
- a model bigger than the budget less the pinned models can never fit: it
  is refused, with the numbers.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Resident:
    """A model holding memory now (loaded, or loading)."""

    id: str
    nbytes: int
    last_used: float  # monotonic seconds
    pinned: bool = False
    busy: bool = False  # requests in flight, or loading


@dataclass(frozen=True)
class Room:
    """Evict these (oldest first) and load; with `wait`, nothing fits until
    busy models go idle: ask again then."""

    evict: tuple[str, ...] = ()
    wait: bool = False


@dataclass(frozen=True)
class NeverFits:
    need: int
    budget: int
    pinned: tuple[str, ...]  # the pinned models holding memory
    pinned_bytes: int


def make_room(need: int, budget: int, residents: list[Resident]) -> Room | NeverFits:
    """What loading a model of `need` bytes takes, with `residents` holding memory."""
    pinned = [r for r in residents if r.pinned]
    pinned_bytes = sum(r.nbytes for r in pinned)
    if need > budget - pinned_bytes:
        return NeverFits(need, budget, tuple(r.id for r in pinned), pinned_bytes)
    free = budget - sum(r.nbytes for r in residents)
    if need <= free:
        return Room()
    evict: list[str] = []
    for r in sorted((r for r in residents if not r.pinned and not r.busy),
                    key=lambda r: r.last_used):  # fmt: skip
        evict.append(r.id)
        free += r.nbytes
        if need <= free:
            return Room(tuple(evict))
    # Even every idle model gone leaves too little: the busy ones must finish
    # first. Evict nothing yet (they may be wanted again meanwhile).
    return Room(wait=True)


def idle_expired(now: float, last_used: float, ttl: float | None, busy: bool, pinned: bool) -> bool:
    """Whether a loaded model's idle TTL has run out."""
    return ttl is not None and not busy and not pinned and now - last_used >= ttl


@dataclass(frozen=True)
class ModelChanges:
    """A new config's models against the running ones, by id."""

    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    changed: tuple[str, ...] = ()  # any setting differs: reloaded
    unchanged: tuple[str, ...] = ()


def model_changes(running: dict[str, object], new: dict[str, object]) -> ModelChanges:
    """`running` and `new`: model id -> its config (compared by ==)."""
    return ModelChanges(
        added=tuple(i for i in new if i not in running),
        removed=tuple(i for i in running if i not in new),
        changed=tuple(i for i in new if i in running and new[i] != running[i]),
        unchanged=tuple(i for i in new if i in running and new[i] == running[i]),
    )
