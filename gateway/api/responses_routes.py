"""The OpenAI Responses API (`/v1/responses`; torch-free)."""

from __future__ import annotations

from fastapi import APIRouter

router = APIRouter()
