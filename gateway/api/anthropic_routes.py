"""The Anthropic Messages API (`/v1/messages`, `/v1/messages/count_tokens`; torch-free)."""

from __future__ import annotations

from fastapi import APIRouter

router = APIRouter()
