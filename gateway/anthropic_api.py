"""Anthropic-compatible routes: /v1/messages and /v1/messages/count_tokens."""

from __future__ import annotations

from fastapi import APIRouter

router = APIRouter()
