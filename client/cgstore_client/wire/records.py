"""Compiled-graph records on the wire (docs/protocol.md "Compiled graphs").

``Manifest`` is what a mint child PUTs; ``Record`` is what a GET answers;
``ResolveRequest``/``ResolveAnswer`` are the booting worker's one round trip.
Fields the store must judge itself (kind, format, the envelope document) are
plain strings and objects here, so a bad value reaches admission and gets its
protocol code (``KIND_RETIRED``, ``ENVELOPE_INVALID``...) instead of a schema
error. Limits are defined here, once: the store enforces them and the client
splits its requests by them.
"""

from __future__ import annotations

import datetime as dt
import json
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from cgstore_client.wire.tokens import MAX_SUB_LEN

#: Keys per resolve request.
MAX_RESOLVE_KEYS = 256
#: Records per page of a listing.
MAX_LIST_LIMIT = 1000
#: Default page size of a listing.
DEFAULT_LIST_LIMIT = 100
#: Largest listing page, as served JSON: a page ends before a record would pass it (never empty while
#: records remain), so a listing's answer stays small whatever ``limit`` asks and the records hold.
MAX_PAGE_BYTES = 1024 * 1024
#: Named components per record.
MAX_COMPONENTS = 64
#: Longest yank reason kept.
MAX_REASON_CHARS = 1000
#: Longest ``release`` label (validated as a name, like a repo name: ``cgstore_client.binding.is_release``).
MAX_RELEASE_CHARS = 128

#: Deepest nesting of a free-form field (``evidence``'s documents, ``input_contract``): containers count.
MAX_FREE_FORM_DEPTH = 16
#: Largest free-form field, as compact UTF-8 JSON.
MAX_FREE_FORM_BYTES = 64 * 1024

_DIGEST = Field(min_length=71, max_length=71)
# A lone UTF-16 surrogate: JSON's "\ud800" parses into a Python str that no UTF-8 encoder accepts.
_SURROGATE = re.compile("[\ud800-\udfff]")


def unservable(document: Any) -> str | None:
    """Why a parsed JSON ``document`` (a free-form field) could be stored but not served back, or None.

    Every string (and object key) must be Unicode scalar values, the document
    nests at most ``MAX_FREE_FORM_DEPTH`` containers and is at most
    ``MAX_FREE_FORM_BYTES``: what is stored is served in every later record
    and listing, which must always serialize. Walked iteratively, so no
    nesting can exhaust the stack.
    """
    stack: list[tuple[Any, int]] = [(document, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                return "holds a string that is not valid Unicode (a lone surrogate)"
            continue
        if not isinstance(item, (dict, list)):
            continue
        if depth >= MAX_FREE_FORM_DEPTH:
            return f"nests deeper than {MAX_FREE_FORM_DEPTH} levels"
        children = [*item.keys(), *item.values()] if isinstance(item, dict) else item
        stack.extend((child, depth + 1) for child in children)
    if len(json.dumps(document, ensure_ascii=False, separators=(",", ":")).encode()) > MAX_FREE_FORM_BYTES:
        return f"is larger than {MAX_FREE_FORM_BYTES} bytes"
    return None


class WireModel(BaseModel):
    """The base of every wire type: unknown fields refused, values immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Artifact(WireModel):
    """The ``.pt2`` blob a record points at."""

    digest: str = _DIGEST
    size: int = Field(ge=0)


class ComponentRef(WireModel):
    """A named CAS component (a safetensors blob in the same repo) the record binds constants from."""

    name: str = Field(min_length=1, max_length=128)
    digest: str = _DIGEST
    size: int = Field(ge=0)


class ToolchainAxis(WireModel):
    """The compiler stack: keyed ``components`` and forensics-only ``recorded`` versions."""

    components: dict[str, str]
    recorded: dict[str, str] = Field(default_factory=dict)


class Axes(WireModel):
    """The four key axes: the ck1 key is recomputed from these on admission."""

    graph: str = Field(max_length=100)
    envelope: dict[str, Any]
    sm: str = Field(max_length=128)
    toolchain: ToolchainAxis


class LayoutStamp(WireModel):
    """How weights exist on disk. ``display`` is stored, never parsed; identity is the digest pair."""

    display: str = Field(max_length=200)
    topology: str = _DIGEST
    quant: str = _DIGEST


class Evidence(WireModel):
    """Timings measured at mint: ride the record, never the (byte-identical) archive."""

    kernel_lane_evidence: dict[str, Any] | None = None
    mint_phases: dict[str, Any] | None = None


class Manifest(WireModel):
    """The body of ``PUT /v1/repos/{o}/{r}/compiled-graphs/{key}``."""

    kind: str = Field(max_length=64)
    format: str = Field(max_length=16)
    family: str = Field(max_length=100)
    lane: str = Field(max_length=64)
    axes: Axes
    artifact: Artifact
    components: list[ComponentRef] = Field(default_factory=list, max_length=MAX_COMPONENTS)
    layout: LayoutStamp | None = None
    evidence: Evidence = Field(default_factory=Evidence)
    #: Optional: when given, it must equal the contract derived from the archive.
    input_contract: dict[str, Any] | None = None
    #: Optional release label (endpoint release, image) discover can narrow to; a name, like a repo's.
    release: str | None = Field(None, max_length=MAX_RELEASE_CHARS)
    #: Optional ``cf1:`` code fingerprint of the model's source (``cgstore_client.binding.code_fingerprint``).
    code: str | None = Field(None, max_length=100)


class Publisher(WireModel):
    principal: str
    jti: str | None


class Yank(WireModel):
    at: dt.datetime
    by: str
    reason: str


class Binding(WireModel):
    """One row of the record's binding table: a constant of the program and where its value comes from."""

    name: str
    fqn: str
    kind: str
    dtype: str | None = None
    shape: list[int | str] | None = None
    load_name: str | None = None
    #: ``checkpoint`` (parameters and persistent buffers: the state_dict) or ``component:<name>``.
    source: str


class Record(WireModel):
    """A published compiled graph: the manifest plus what admission derived and who published it."""

    key: str
    repo: str
    manifest: Manifest
    input_contract: dict[str, Any]
    binding_table: list[Binding]
    kernel_lane: dict[str, Any] | None
    publisher: Publisher
    created_at: dt.datetime
    health: Literal["ok", "blob_missing", "blob_corrupt"] = "ok"
    yank: Yank | None = None
    #: The publish receipt (``cgstore_client.receipts``); None only for records published before receipts.
    receipt: str | None = None
    #: ``bs1:`` of the tensors bound from the checkpoint; None only for records published before discovery.
    binding_signature: str | None = None
    #: Workers' reports that this graph is not their live model (``…/{key}:report``); never yanks by itself.
    drift_reports: int = 0


class PublishAnswer(WireModel):
    """201 (created) or 200 (the same bytes were already published under this key)."""

    status: Literal["created", "exists"]
    key: str
    repo: str
    artifact: Artifact
    #: The signed publish receipt (``cgstore_client.receipts``): the same one a 200 re-publish answers.
    receipt: str | None = None


class RecordPage(WireModel):
    """One page of a repo's records: at most ``limit`` records and ``MAX_PAGE_BYTES`` of JSON.

    ``next_cursor`` is None on the last page; a page may hold fewer records than
    asked and still have a next one (the byte bound cut it). It is opaque: pass
    it back as ``cursor`` unchanged, to the same repo's listing.
    """

    records: list[Record]
    next_cursor: str | None = None


class YankRequest(WireModel):
    reason: str = Field(min_length=1, max_length=MAX_REASON_CHARS)
    #: Whose record of the key: in a private cache each publisher has its own (default: the caller's).
    publisher: str | None = Field(None, min_length=1, max_length=MAX_SUB_LEN)


class ResolveRequest(WireModel):
    family: str = Field(min_length=1, max_length=100)
    keys: list[str] = Field(min_length=1, max_length=MAX_RESOLVE_KEYS)


class DownloadRef(WireModel):
    """A blob the worker downloads directly: a presigned storage URL, or the store's blob URL."""

    digest: str
    size: int
    url: str


class ComponentDownload(DownloadRef):
    name: str


class RecordFacts(WireModel):
    """What a booting worker needs of a hit; the full record is one GET away (``href``).

    Deliberately small (a resolve answers up to 256 of these): the kernel-lane
    verdict, input contract and binding table travel inside the archive the
    worker downloads anyway, and in the full record.
    """

    kind: str
    format: str
    family: str
    lane: str
    sm: str
    graph: str
    envelope_digest: str
    toolchain_digest: str
    layout: LayoutStamp | None
    created_at: dt.datetime
    href: str


class ResolveHit(WireModel):
    key: str
    status: Literal["hit"] = "hit"
    repo: str
    record: RecordFacts
    artifact: DownloadRef
    components: list[ComponentDownload]
    #: The record's publish receipt, verifiable offline against ``GET /v1/keys``.
    receipt: str | None = None


class ResolveMiss(WireModel):
    """A miss: identical whether the key is absent, yanked, unhealthy or held only where the caller cannot read.

    ``detail``: only from a regional mirror that could not ask its upstream
    (``{"upstream": "unavailable"}``): the key may exist there.
    """

    key: str
    status: Literal["miss"] = "miss"
    detail: dict[str, str] | None = None

    @model_serializer(mode="wrap")
    def _without_absent_detail(self, handler):
        # Absent, not null: a miss's bytes stay what clients from before the field parse.
        document = handler(self)
        if document.get("detail") is None:
            document.pop("detail", None)
        return document


ResolveItem = Annotated[ResolveHit | ResolveMiss, Field(discriminator="status")]


class ResolveAnswer(WireModel):
    """One answer per requested key, in request order (duplicates answered again)."""

    answers: list[ResolveItem]
