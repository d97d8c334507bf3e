"""Helpers of the audit tests: reading the table as the store wrote it."""

from __future__ import annotations

import pytest
from sqlalchemy import func, select

from cgstore.audit.models import AuditEvent


def rows(store, *conditions) -> list[AuditEvent]:
    with store.context.db.session() as session:
        return list(session.scalars(select(AuditEvent).where(*conditions).order_by(AuditEvent.id)))


def last_id(store) -> int:
    with store.context.db.session() as session:
        return session.scalar(select(func.max(AuditEvent.id))) or 0


@pytest.fixture
def admin(store) -> str:
    return store.mint("auditor", "*/*:admin")
