"""Request and response bodies of the blobs endpoints."""

from __future__ import annotations

from pydantic import BaseModel, Field


class MissingQuery(BaseModel):
    digests: list[str] = Field(max_length=1024)


class MissingAnswer(BaseModel):
    missing: list[str]
