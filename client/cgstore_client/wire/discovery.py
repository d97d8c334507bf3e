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

from pydantic import Field, model_serializer

from cgstore_client.wire.records import MAX_REASON_CHARS, MAX_RELEASE_CHARS, ResolveHit, ToolchainAxis, WireModel

#: Candidates a discover answers when the caller does not say.
DEFAULT_DISCOVER_LIMIT = 4
#: The most candidates one discover answers.
MAX_DISCOVER_LIMIT = 16


class Declaration(WireModel):
    """A declaration: what the worker will run, known before tracing (discover's and a claim's body)."""

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


class DiscoverRequest(Declaration):
    """A declaration to look up: the matching live records, at most ``limit``, explained on a miss if asked."""

    #: A JSON integer: ``"4"``, ``true`` and ``4.0`` are refused, not read as 4 (or 1).
    limit: int = Field(DEFAULT_DISCOVER_LIMIT, ge=1, le=MAX_DISCOVER_LIMIT, strict=True)
    #: On a miss, say why (``DiscoverAnswer.miss``). Asked for, so an answer without it stays what
    #: clients from before the field parse.
    explain: bool = Field(False, strict=True)


class Candidate(ResolveHit):
    """A matching live record, in resolve's hit shape, with what discovery matched on."""

    binding_signature: str | None = None
    release: str | None = None


class AxisDifference(WireModel):
    """One axis on which the nearest readable record differs from the declaration.

    ``axis``: ``envelope`` (``name`` the field), ``sm``, ``toolchain`` (``name``
    the keyed component), ``library`` (``name`` a recorded model-library
    version), ``release``, ``binding_signature`` or ``code``. ``here`` is the
    declaration's value, ``recorded`` the record's (None: absent).
    """

    axis: str
    name: str | None = None
    here: Any = None
    recorded: Any = None


class NearestRecord(WireModel):
    """The readable live record of the family closest to the declaration (fewest differing axes)."""

    key: str
    repo: str
    differences: list[AxisDifference]


class MissExplanation(WireModel):
    """Why nothing matched, from the records the caller may read only (never another principal's).

    ``records``: live records of the family in the repos searched (``at_least``
    when the store looked at its bound only); ``repos``: where they are;
    ``similar_families``: when there are none, readable families spelled
    nearly alike; ``detail``: all of it in one sentence.
    """

    detail: str
    records: int
    at_least: bool = False
    repos: list[str] = Field(default_factory=list)
    nearest: NearestRecord | None = None
    similar_families: list[str] = Field(default_factory=list)


class DiscoverAnswer(WireModel):
    """Best first (``root/*``, then the caller's own, newest first); empty when nothing matches or is readable.

    ``miss``: only when the request asked (``explain``) and nothing matched.
    ``detail``: only from a regional mirror that could not ask its upstream
    (``{"upstream": "unavailable"}``): the answer holds what the mirror has.
    """

    candidates: list[Candidate]
    miss: MissExplanation | None = None
    detail: dict[str, str] | None = None

    @model_serializer(mode="wrap")
    def _without_absent_miss(self, handler):
        # Absent, not null: clients from before the fields refuse unknown fields.
        document = handler(self)
        for name in ("miss", "detail"):
            if document.get(name) is None:
                document.pop(name, None)
        return document


class DriftReport(WireModel):
    """A worker measured another graph than the record's: what it measured, and why it looked."""

    measured_graph: str = Field(min_length=1, max_length=100)
    reason: str = Field(min_length=1, max_length=MAX_REASON_CHARS)
