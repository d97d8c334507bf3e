"""Wire types of discovery at boot: ``POST /v1/compiled-graphs:discover`` and drift reports.

A worker knows its declaration (family, envelope, card, toolchain with the
model libraries' versions) before it has traced anything; discover answers the
live records that match it, best first, each in resolve's hit shape plus its
binding signature. A worker whose background confirmation finds that a
served graph is not its live model's reports it with
``POST /v1/repos/{o}/{r}/compiled-graphs/{key}:report``.

The derivations both sides compute identically (the binding signature, the
code fingerprint, the discovery digest) live in ``cgstore_client.binding``.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from cgstore_client.wire.records import MAX_REASON_CHARS, MAX_RELEASE_CHARS, ResolveHit, ToolchainAxis, WireModel

#: Candidates a discover answers when the caller does not say.
DEFAULT_DISCOVER_LIMIT = 4
#: The most candidates one discover answers.
MAX_DISCOVER_LIMIT = 16


class DiscoverRequest(WireModel):
    """A declaration: what the worker will run, known before tracing."""

    family: str = Field(min_length=1, max_length=100)
    #: What ``Envelope.from_dict`` accepts: the caller's form or the canonical document.
    envelope: dict[str, Any]
    sm: str = Field(min_length=1, max_length=128)
    #: As in a manifest's axes: the keyed components and the recorded model-library versions.
    toolchain: ToolchainAxis
    #: An opaque label (endpoint release, image digest); absent matches any.
    release: str | None = Field(None, min_length=1, max_length=MAX_RELEASE_CHARS)
    #: ``bs1:…`` of the live model: only records binding exactly these tensors.
    binding_signature: str | None = Field(None, max_length=100)
    #: ``cf1:…`` of the model's source: narrows to records minted from the same code, when they recorded one.
    code: str | None = Field(None, max_length=100)
    #: A JSON integer: ``"4"``, ``true`` and ``4.0`` are refused, not read as 4 (or 1).
    limit: int = Field(DEFAULT_DISCOVER_LIMIT, ge=1, le=MAX_DISCOVER_LIMIT, strict=True)


class Candidate(ResolveHit):
    """A matching live record, in resolve's hit shape, with what discovery matched on."""

    binding_signature: str | None = None
    release: str | None = None


class DiscoverAnswer(WireModel):
    """Best first (``root/*``, then the caller's own, newest first); empty when nothing matches or is readable."""

    candidates: list[Candidate]


class DriftReport(WireModel):
    """A worker measured another graph than the record's: what it measured, and why it looked."""

    measured_graph: str = Field(min_length=1, max_length=100)
    reason: str = Field(min_length=1, max_length=MAX_REASON_CHARS)
