"""Helpers for the compiled-graph API tests: upload real archives and components, build manifests."""

from __future__ import annotations

import struct
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import blake3
import httpx

from cgstore_client.archive import ArchiveReport
from cgstore_client.components import SAFETENSORS_DTYPES, encode_header
from cgstore_client.keys import Envelope, Toolchain, ck1

ENVELOPE = {"shapes": [[1024, 1024]], "text_len": 512, "guidance": [3.5]}
TOOLCHAIN = {"torch": "2.13.0", "triton": "3.6.0"}
RECORDED = {"diffusers": "0.35.1"}
FAMILY = "tiny-family"
LANE = "baseline+packed"


def digest_of(data: bytes) -> str:
    return "blake3:" + blake3.blake3(data).hexdigest()


def safetensors_bytes(tensors: dict[str, tuple[str, list[int]]], metadata: dict[str, str] | None = None) -> bytes:
    """A real safetensors file (F32 tensors count 0, 1, 2...; others are zeros) for ``{name: (dtype, shape)}``."""
    header = encode_header(tensors, metadata)
    body = b""
    for dtype, shape in tensors.values():
        count = 1
        for dim in shape:
            count *= dim
        body += (
            struct.pack(f"<{count}f", *range(count)) if dtype == "F32" else bytes(count * SAFETENSORS_DTYPES[dtype][1])
        )
    return header + body


#: The component archive A needs: its non-persistent buffer and its lifted tensor literal.
CONSTANTS_A = {"table": ("F32", [3]), "lifted_tensor_0": ("F32", [4])}


@dataclass
class Blob:
    data: bytes

    @property
    def digest(self) -> str:
        return digest_of(self.data)

    @property
    def size(self) -> int:
        return len(self.data)


@dataclass
class Publication:
    """A manifest and the key derived from it (the mint child's side of a publish)."""

    key: str
    manifest: dict[str, Any]
    artifact: Blob
    components: dict[str, Blob] = field(default_factory=dict)

    def path(self, owner: str, repo: str) -> str:
        return f"/v1/repos/{owner}/{repo}/compiled-graphs/{self.key}"


def unique_envelope() -> dict[str, Any]:
    """An envelope (so a key) no other test uses: records of it resolve only where a test put them."""
    guidance = f"{uuid.uuid4().int % 10**5}.{uuid.uuid4().int % 10**9}"  # |g| <= 10**6, as envelopes require
    return {"shapes": [[8, 8]], "text_len": 5, "guidance": [guidance]}


def publication(
    archive: Path,
    report: ArchiveReport,
    *,
    components: dict[str, bytes] | None = None,
    envelope: dict[str, Any] | None = None,
    sm: str | None = None,
    graph: str | None = None,
    toolchain: dict[str, str] | None = None,
    family: str = FAMILY,
    **manifest_fields: Any,
) -> Publication:
    """The manifest a mint child sends for ``archive``, with its key derived from the axes."""
    envelope = ENVELOPE if envelope is None else envelope
    sm = sm or report.sm
    graph = graph or report.graph_digest
    toolchain = toolchain or TOOLCHAIN
    blobs = {name: Blob(data) for name, data in (components if components is not None else {}).items()}
    artifact = Blob(archive.read_bytes())
    manifest: dict[str, Any] = {
        "kind": "aot-inductor",
        "format": "pt2",
        "family": family,
        "lane": LANE,
        "axes": {
            "graph": graph,
            "envelope": envelope,
            "sm": sm,
            "toolchain": {"components": toolchain, "recorded": RECORDED},
        },
        "artifact": {"digest": artifact.digest, "size": artifact.size},
        "components": [{"name": n, "digest": b.digest, "size": b.size} for n, b in blobs.items()],
        "layout": {
            "display": "tiny.diffusers@1+cozy.fp8-rowwise@1",
            "topology": digest_of(b"topology"),
            "quant": digest_of(b"quant"),
        },
        "evidence": {
            "kernel_lane_evidence": {"baseline+packed": {"step_s": "0.228"}},
            "mint_phases": {"compile_s": "19.4"},
        },
    }
    manifest.update(manifest_fields)
    key = (
        ck1(graph, Envelope.from_dict(envelope), sm, Toolchain({**toolchain, **RECORDED}))
        if "text_len" in envelope
        else "ck1-" + "0" * 56
    )
    return Publication(key, manifest, artifact, blobs)


def upload(client: httpx.Client, owner: str, repo: str, blob: Blob) -> None:
    response = client.put(f"/v1/repos/{owner}/{repo}/blobs/{blob.digest}", content=blob.data)
    assert response.status_code == 201, response.text


def upload_all(client: httpx.Client, owner: str, repo: str, pub: Publication) -> None:
    upload(client, owner, repo, pub.artifact)
    for blob in pub.components.values():
        upload(client, owner, repo, blob)


def publish(
    client: httpx.Client, owner: str, repo: str, pub: Publication, *, send_blobs: bool = True
) -> httpx.Response:
    if send_blobs:
        upload_all(client, owner, repo, pub)
    return client.put(pub.path(owner, repo), json=pub.manifest)


def error_code(response: httpx.Response) -> str:
    return response.json()["error"]["code"]


# -- records written straight into the database (many of them, cheaply) -------------------------


def random_key() -> str:
    """A valid ck1 key nobody derived: a record cloned under it resolves only where a test put it."""
    return "ck1-" + uuid.uuid4().hex + uuid.uuid4().hex[:24]


def make_repo(store, owner: str, name: str, *, visibility: str = "owner", holder: str | None = None) -> int:
    """A repo row (and, with ``holder``, the owner claimed by that registered principal); its id."""
    return make_repos(store, owner, [name], visibility=visibility, holder=holder)[0]


def make_repos(
    store, owner: str, names: list[str], *, visibility: str = "owner", holder: str | None = None
) -> list[int]:
    """Repo rows under ``owner`` in one transaction (see ``make_repo``); their ids."""
    from cgstore.owners.models import Owner
    from cgstore.repos.models import Repo

    with store.context.db.session() as session:
        if holder is not None and session.get(Owner, owner) is None:
            session.add(Owner(slug=owner, principal=holder))
            session.flush()
        repos = [Repo(owner=owner, name=name, visibility=visibility, created_by=holder or "test") for name in names]
        session.add_all(repos)
        session.flush()
        return [repo.id for repo in repos]


def clone_record(store, source_key: str, *, repo_id: int, publisher: str | None = None, key: str | None = None) -> str:
    """A live copy of the live record of ``source_key`` (with its components) in ``repo_id``; its key.

    What a tenant gets by publishing the same bytes again elsewhere, without
    paying admission for each of hundreds of copies. ``publisher`` also sets the
    write-once scope (as a publish into a private cache does).
    """
    return clone_records(store, source_key, [(repo_id, publisher, key)])[0]


def clone_records(store, source_key: str, copies: list[tuple[int, str | None, str | None]]) -> list[str]:
    """``clone_record`` for each ``(repo_id, publisher, key)``, in one transaction; their keys."""
    from sqlalchemy import select

    from cgstore.compiled_graphs.models import CompiledGraph, CompiledGraphComponent

    keys = []
    with store.context.db.session() as session:
        source = session.scalars(
            select(CompiledGraph)
            .where(CompiledGraph.key == source_key, CompiledGraph.yanked_at.is_(None))
            .order_by(CompiledGraph.id)
        ).first()
        components = session.scalars(
            select(CompiledGraphComponent).where(CompiledGraphComponent.record_id == source.id)
        ).all()
        columns = {c.key: getattr(source, c.key) for c in CompiledGraph.__table__.columns if c.key != "id"}
        for repo_id, publisher, key in copies:
            values = dict(columns, repo_id=repo_id, key=key or random_key(), drift_reports=0)
            if publisher is not None:
                values.update(publisher=publisher, scope=publisher)
            copy = CompiledGraph(**values)
            session.add(copy)
            session.flush()
            session.add_all(
                CompiledGraphComponent(record_id=copy.id, name=c.name, digest=c.digest, size=c.size) for c in components
            )
            keys.append(values["key"])
    return keys
