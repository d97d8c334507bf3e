"""The resources one app instance shares between requests, and the dependency that hands them out.

It lives beside ``app.py`` (not in ``core/``) because it names feature
services: it is where the app is composed.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from cgstore.audit.denials import DenialLog
from cgstore.core.db import Database
from cgstore.core.metrics import Metrics
from cgstore.settings import Settings
from cgstore.storage import Storage
from cgstore.tokens.service import TokenService


@dataclass
class StoreContext:
    settings: Settings
    db: Database
    storage: Storage
    tokens: TokenService
    metrics: Metrics
    denials: DenialLog


def get_context(request: Request) -> StoreContext:
    return request.app.state.context
