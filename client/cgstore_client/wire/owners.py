"""Bodies of ``POST /v1/owners``, ``PUT /v1/repos/{owner}/{repo}`` and the preflight (docs/protocol.md, "Names")."""

from __future__ import annotations

import datetime as dt
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Visibility = Literal["owner", "principal"]


class OwnerClaim(BaseModel):
    """Claim an owner slug for the calling principal (needs ``owner:create``)."""

    model_config = ConfigDict(extra="forbid")

    # Any string: the store's name grammar decides (400 NAME_INVALID, 403 ROOT_RESERVED).
    slug: str = Field(max_length=200)


class OwnerInfo(BaseModel):
    slug: str
    principal: str
    created_at: dt.datetime


class RepoSettings(BaseModel):
    """Create a repo, or change its visibility."""

    model_config = ConfigDict(extra="forbid")

    visibility: Visibility


class RepoInfo(BaseModel):
    owner: str
    name: str
    visibility: Visibility
    created_by: str
    created_at: dt.datetime
