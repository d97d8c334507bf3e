"""Imports every feature's models so ``Base.metadata`` knows all tables (Alembic, tests)."""

from cgstore.audit.models import AuditEvent
from cgstore.blobs.models import Blob, RepoBlob, RepoBlobHolder, UploadSession
from cgstore.claims.models import DeclarationClaim
from cgstore.compiled_graphs.models import CompiledGraph, CompiledGraphComponent
from cgstore.core.db import Base
from cgstore.mirror.models import MirrorState
from cgstore.operations.models import Lease, ScrubCursor
from cgstore.owners.models import Owner, Principal
from cgstore.repos.models import Repo
from cgstore.tokens.models import SigningKey, TokenRecord

__all__ = [
    "AuditEvent",
    "Base",
    "Blob",
    "CompiledGraph",
    "CompiledGraphComponent",
    "DeclarationClaim",
    "Lease",
    "MirrorState",
    "Owner",
    "Principal",
    "Repo",
    "RepoBlob",
    "RepoBlobHolder",
    "ScrubCursor",
    "SigningKey",
    "TokenRecord",
    "UploadSession",
]
