"""A model's `policy:` section of the YAML config (validated by pydantic).

It lives with the policy that reads it; gateway/config.py embeds it in each
model's config.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class PolicyConfig(BaseModel):
    """When speculation is used (policies/decide.py). "auto" defers to the
    round costs measured live on this machine (policies/live_costs.py), with
    `specgate tune`'s measurements, where they exist, as the prior; until
    anything is measured, a model speculates when idle and batches when busy."""

    model_config = ConfigDict(extra="forbid")

    # Drafts per round: "auto" (the cost model picks 1..the configured depth)
    # or a number (always that many, capped by what the drafter can draft).
    depth: Literal["auto"] | int = "auto"
    # Requests in flight (this one included) from which plain batched decoding
    # is used: "auto" (the cost model; unmeasured: 2) or a number.
    concurrency_threshold: Literal["auto"] | int = "auto"
    # Requests with sampling penalties: "auto" (speculate when the drafter
    # applies them per draft position, as every in-process engine does) or
    # "plain" (always decode them plainly).
    penalties: Literal["auto", "plain"] = "auto"
    # Contexts (prompt and output so far) longer than this decode plainly;
    # "auto": the cost model decides.
    long_context_tokens: Literal["auto"] | int = "auto"
    # Speculate only for models with at least this many parameters.
    min_params: int | None = Field(None, gt=0)
    # Whether requests may choose (X-Specgate-Method / X-Specgate-Depth).
    allow_overrides: bool = True
    # At most one idle request in this many tries a plan the estimates do not
    # favour, so a method that starts winning is found again (policies/
    # explore.py); 0: never explore (plans stay with what was measured).
    explore_every: int = Field(16, ge=0)
    # No request may run slower than this times plain decoding because of
    # speculation (policies/request_guard.py): one whose own rounds lose
    # (over 8 rounds) decodes plainly until it is back above it; 0: no bound.
    request_floor: float = Field(0.9, ge=0, lt=1)

    @field_validator("depth", "concurrency_threshold", "long_context_tokens")
    @classmethod
    def _positive(cls, v):
        if isinstance(v, int) and v < 1:
            raise ValueError("must be 'auto' or a number >= 1")
        return v
