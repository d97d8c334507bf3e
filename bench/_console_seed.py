"""Seeds a running store's database for ``bench/console.py``: live records and a long audit log, in bulk.

Publishing 100 k records through HTTP would take hours of archive reading and
measure nothing about the console, so the rows go straight in through the
models' tables (SQLAlchemy Core, so each dialect gets its own types): per record
what a publish writes (the repo on its first write, the artifact blob and its
repo link, the ``compiled_graphs`` row with its JSON columns, one row per
component, components shared within a family), spread over owners, repos,
families, sms, lanes and publishers, created over the last ``DAYS`` days.

The audit log is appended the way ``audit.chain.append`` appends, a batch at a
time: bump ``audit_head`` by the batch's size first (the lock every appender
queues on, so the running store's own appends interleave safely), give the
entries the ids it hands out, chain each to the one before by
``chain.entry_digest``, then move the head's digest. Entries are a mix of what
the store writes: publishes (created, exists, ``KEY_CONFLICT``, refusals),
blob uploads, token mints and revocations, repo creations, denied requests and
aggregated 401 rows (``count`` > 1, the aggregate's detail), by 200 actors,
over the last ``DAYS`` days; each publish names one of the seeded records, so a
record's history finds it.
"""

from __future__ import annotations

import datetime as dt
import random
import time
from collections.abc import Iterator
from types import SimpleNamespace

from sqlalchemy import create_engine, func, insert, select, text, update

from cgstore.audit.chain import HEAD_ID, entry_digest
from cgstore.audit.models import AuditEvent, AuditHead
from cgstore.blobs.models import Blob, RepoBlob
from cgstore.compiled_graphs.models import CompiledGraph, CompiledGraphComponent
from cgstore.repos.models import Repo

OWNERS = ("acme", "globex", "initech", "umbrella", "hooli")
REPOS_PER_OWNER = 4
FAMILIES = ("flux2", "sdxl", "llama3", "qwen2", "whisper", "gpt2", "bert", "t5")
SMS = ("sm_80", "sm_86", "sm_89", "sm_90")
LANES = ("baseline+dense", "baseline+packed", "fp8+packed")
PUBLISHERS = tuple(f"ci-{n}" for n in range(30))
ACTORS = tuple(f"user-{n}" for n in range(200))
DAYS = 60
BATCH = 5000
ARTIFACT_SIZE = 1_565_188

_KERNEL_LANE = {
    "winner": "baseline+packed",
    "rule": "fit-constrained-speed/1",
    "binding": "speed",
    "margin_fraction": 0.05,
    "candidates": ["baseline+dense", "baseline+packed"],
    "fit": None,
}
_CONTRACT = {
    "v": 1,
    "inputs": [{"name": "x", "dtype": "bfloat16", "shape": ["batch", 1024]}],
    "dims": {"batch": [1, 8]},
}
_BINDINGS = [
    {
        "name": f"layers_{n}_weight",
        "fqn": f"layers.{n}.weight",
        "kind": "parameter",
        "dtype": "bfloat16",
        "shape": [1024, 1024],
        "load_name": None,
        "source": "component:consts",
    }
    for n in range(24)
]
_TOOLCHAIN = {"components": {"torch": "2.13.0"}, "recorded": {"diffusers": "0.36.0"}}


def fake_digest(kind: str, n: int) -> str:
    return "blake3:" + f"{kind}{n:x}".encode().hex().ljust(64, "0")[:64]


def fake_key(n: int) -> str:
    return "ck1-" + f"{n:056x}"


def repo_names() -> list[tuple[str, str]]:
    return [(owner, f"models-{n}") for owner in OWNERS for n in range(REPOS_PER_OWNER)]


def record_repo(n: int) -> tuple[str, str]:
    names = repo_names()
    return names[n % len(names)]


def _batches(total: int) -> Iterator[range]:
    for low in range(0, total, BATCH):
        yield range(low, min(low + BATCH, total))


def _moment(now: dt.datetime, n: int, total: int) -> dt.datetime:
    """Row ``n`` of ``total``, evenly over the last ``DAYS`` days, oldest first."""
    return now - dt.timedelta(days=DAYS) * (1 - n / max(total, 1))


def seed_records(engine, total: int) -> None:
    """``total`` live records over the repos, each with its own artifact blob and its family's two components."""
    now = dt.datetime.now(dt.UTC)
    with engine.begin() as conn:
        conn.execute(
            insert(Repo),
            [
                {
                    "owner": owner,
                    "name": name,
                    "visibility": "owner",
                    "created_by": PUBLISHERS[0],
                    "created_at": now - dt.timedelta(days=DAYS + 1),
                }
                for owner, name in repo_names()
            ],
        )
        repo_ids = {(owner, name): id_ for id_, owner, name in conn.execute(select(Repo.id, Repo.owner, Repo.name))}
        conn.execute(
            insert(Blob),
            [
                {
                    "digest": fake_digest(f"c{name}", f),
                    "size": size,
                    "created_at": now - dt.timedelta(days=DAYS),
                    "linked_at": now - dt.timedelta(days=DAYS),
                }
                for f in range(len(FAMILIES))
                for name, size in (("consts", 268_435_456), ("tok", 2_097_152))
            ],
        )
    for batch in _batches(total):
        records, blobs, links = [], [], []
        for n in batch:
            at = _moment(now, n, total)
            repo_id = repo_ids[record_repo(n)]
            family = FAMILIES[n % len(FAMILIES)]
            blobs.append({"digest": fake_digest("a", n), "size": ARTIFACT_SIZE, "created_at": at, "linked_at": at})
            links.append(
                {"repo_id": repo_id, "digest": fake_digest("a", n), "linked_by": PUBLISHERS[n % 30], "created_at": at}
            )
            records.append(_record(n, repo_id, family, at))
        with engine.begin() as conn:
            conn.execute(insert(Blob), blobs)
            conn.execute(insert(RepoBlob), links)
            conn.execute(insert(CompiledGraph), records)
            first = conn.scalar(select(func.min(CompiledGraph.id)).where(CompiledGraph.key == fake_key(batch[0])))
            conn.execute(
                insert(CompiledGraphComponent),
                [
                    {
                        "record_id": first + i,
                        "name": name,
                        "digest": fake_digest(f"c{name}", (batch[0] + i) % len(FAMILIES)),
                        "size": size,
                    }
                    for i in range(len(batch))
                    for name, size in (("consts", 268_435_456), ("tok", 2_097_152))
                ],
            )


def _record(n: int, repo_id: int, family: str, at: dt.datetime) -> dict:
    envelope = {"v": 1, "shapes": [[1024, 1024]], "text_len": 77 + n % 400, "guidance": ["3.5"], "batch_sizes": [1]}
    return {
        "repo_id": repo_id,
        "key": fake_key(n),
        "kind": "aot-inductor",
        "format": "pt2",
        "family": family,
        "lane": LANES[n % len(LANES)],
        "sm": SMS[(n // 7) % len(SMS)],
        "graph_digest": fake_digest("g", n),
        "envelope": envelope,
        "envelope_digest": fake_digest("e", n % 400),
        "toolchain": _TOOLCHAIN,
        "toolchain_digest": fake_digest("t", 0),
        "recorded_versions": _TOOLCHAIN["recorded"],
        "artifact_digest": fake_digest("a", n),
        "artifact_size": ARTIFACT_SIZE,
        "component_set": fake_digest("s", n % len(FAMILIES)),
        "layout_display": f"{family}.diffusers@1",
        "layout_topology": fake_digest("l", 0),
        "layout_quant": fake_digest("q", 0),
        "input_contract": _CONTRACT,
        "binding_table": _BINDINGS,
        "kernel_lane": _KERNEL_LANE,
        "publisher": PUBLISHERS[n % len(PUBLISHERS)],
        "publisher_jti": f"{n:032x}",
        "created_at": at,
        "health": "ok",
        "scope": "",
        "discovery_digest": fake_digest("d", n // 4),
        "drift_reports": 0,
    }


#: One entry in this many is a ``key.rotate`` (10 in the full 1 M).
RARE_EVERY = 100_000


def _audit_fields(rng: random.Random, n: int, records: int) -> dict:
    """One entry's columns (``at`` and the chain columns are set by the caller)."""
    actor = ACTORS[rng.randrange(len(ACTORS))]
    jti = f"{rng.getrandbits(128):032x}"
    roll = rng.random()
    if n % RARE_EVERY == RARE_EVERY - 1:  # a key rotation now and then: an action prefix few entries have
        return {
            "actor": "platform",
            "jti": None,
            "action": "key.rotate",
            "target": f"kid-{n}",
            "repo": None,
            "outcome": "ok",
            "source": None,
            "count": 1,
            "detail": {},
        }
    if roll < 0.45 and records:
        rec = rng.randrange(records)
        owner, name = record_repo(rec)
        outcome = rng.choices(("ok", "KEY_CONFLICT", "ADMISSION_REFUSED", "FORBIDDEN"), (90, 3, 5, 2))[0]
        detail = (
            {"result": "created", "artifact": fake_digest("a", rec), "component_set": fake_digest("s", 0)}
            if outcome == "ok"
            else {"message": "refused", "detail": {"key": fake_key(rec)}}
        )
        return {
            "actor": PUBLISHERS[rec % len(PUBLISHERS)],
            "jti": jti,
            "action": "compiled_graph.publish",
            "target": f"{owner}/{name}:{fake_key(rec)}",
            "repo": f"{owner}/{name}",
            "outcome": outcome,
            "source": None if outcome == "ok" else "-",
            "count": 1,
            "detail": detail,
        }
    if roll < 0.75:
        owner, name = record_repo(n)
        return {
            "actor": actor,
            "jti": jti,
            "action": "blob.upload",
            "target": f"{owner}/{name}@{fake_digest('u', n)}",
            "repo": f"{owner}/{name}",
            "outcome": "ok",
            "source": None,
            "count": 1,
            "detail": {"size": ARTIFACT_SIZE, "wrote": True},
        }
    if roll < 0.85:
        action = rng.choice(("token.mint", "token.mint", "token.revoke", "repo.create", "owner.claim"))
        return {
            "actor": actor,
            "jti": jti,
            "action": action,
            "target": f"{n:032x}",
            "repo": None,
            "outcome": "ok",
            "source": None,
            "count": 1,
            "detail": {"grants": ["acme/*:read"]},
        }
    if roll < 0.95:
        owner, name = record_repo(n)
        return {
            "actor": actor,
            "jti": jti,
            "action": rng.choice(
                ("GET /v1/repos/{owner}/{repo}/blobs/{digest}", "PUT /v1/repos/{owner}/{repo}/compiled-graphs/{key}")
            ),
            "target": f"/v1/repos/{owner}/{name}/blobs/{fake_digest('x', n)}",
            "repo": f"{owner}/{name}",
            "outcome": "FORBIDDEN",
            "source": f"10.0.{n % 256}.{n % 7}",
            "count": 1,
            "detail": {"message": "the token grants no access to this repo"},
        }
    count = rng.randrange(2, 500)
    return {
        "actor": "-",
        "jti": None,
        "action": "auth",
        "target": "/v1/compiled-graphs:resolve",
        "repo": None,
        "outcome": "TOKEN_INVALID",
        "source": f"203.0.113.{n % 256}",
        "count": count,
        "detail": {
            "aggregated": True,
            "last_at": "2026-12-01T00:00:00+00:00",
            "messages": ["bad signature"],
            "paths": ["/v1/compiled-graphs:resolve"],
        },
    }


def seed_audit(engine, total: int, records: int) -> None:
    """``total`` chained audit entries after the store's own, ``at`` spread over the last ``DAYS`` days."""
    rng = random.Random(20261205)
    now = dt.datetime.now(dt.UTC)
    for batch in _batches(total):
        entries = []
        for n in batch:
            fields = _audit_fields(rng, n, records)
            fields["at"] = _moment(now, n, total)
            entries.append(fields)
        with engine.begin() as conn:
            bump = (
                update(AuditHead)
                .where(AuditHead.id == HEAD_ID)
                .values(last_id=AuditHead.last_id + len(entries))
                .returning(AuditHead.last_id, AuditHead.digest)
            )
            last_id, prev = conn.execute(bump).one()
            for offset, fields in enumerate(entries):
                fields["id"] = last_id - len(entries) + 1 + offset
                fields["prev"] = prev
                fields["digest"] = prev = entry_digest(SimpleNamespace(**fields))
            conn.execute(insert(AuditEvent), entries)
            conn.execute(update(AuditHead).where(AuditHead.id == HEAD_ID).values(digest=prev))


def seed(database_url: str, records: int, audit_rows: int, log=print) -> None:
    """Both seeds, then fresh planner statistics (what autovacuum would reach soon after such a load)."""
    engine = create_engine(database_url)
    started = time.perf_counter()
    seed_records(engine, records)
    log(f"  seeded {records} records in {time.perf_counter() - started:.1f} s")
    started = time.perf_counter()
    seed_audit(engine, audit_rows, records)
    log(f"  seeded {audit_rows} audit entries in {time.perf_counter() - started:.1f} s")
    if engine.dialect.name == "postgresql":
        with engine.connect() as conn:
            conn = conn.execution_options(isolation_level="AUTOCOMMIT")
            conn.execute(text("VACUUM ANALYZE"))
            conn.execute(text("CHECKPOINT"))
    engine.dispose()
