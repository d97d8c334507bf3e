"""The resources one app instance shares between requests, and the dependency that hands them out.

It lives beside ``app.py`` (not in ``core/``) because it names feature
services: it is where the app is composed.
"""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass, field

from fastapi import Request

from cgstore.audit.denials import DenialLog
from cgstore.core.cursors import CursorSeal
from cgstore.core.db import Database
from cgstore.core.feeds import HeadWatch
from cgstore.core.metrics import Metrics
from cgstore.mirror.flight import MirrorRuntime
from cgstore.settings import Settings
from cgstore.storage import Storage
from cgstore.tokens.service import TokenService


@dataclass(eq=False)  # one per app, compared and hashed by identity (``console.service.Aggregates``)
class StoreContext:
    settings: Settings
    db: Database
    storage: Storage
    tokens: TokenService
    metrics: Metrics
    denials: DenialLog
    #: Seals and opens the listings' opaque cursors (``core.cursors``).
    cursors: CursorSeal
    #: Wakes this process's long-polls of the record events feed (``core.feeds``, ``compiled_graphs.events``).
    feed: HeadWatch
    #: A regional mirror's upstream client, flights and figures (``mirror/``); None: not a mirror.
    mirror: MirrorRuntime | None = None
    #: Names this store process among replicas (the holder of its leases).
    instance: str = field(default_factory=lambda: instance_id())


def instance_id() -> str:
    """A name for this store process that no other process (here or on another host) shares."""
    return f"{socket.gethostname()[:100]}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def get_context(request: Request) -> StoreContext:
    return request.app.state.context
