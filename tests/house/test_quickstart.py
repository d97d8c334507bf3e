"""The README's quick start, done literally: serve on the embedded default, mint, curl up and down.

``test_the_readme_quick_start_runs_as_written`` runs the README's own block
(``<!-- example: quick-start -->``) with bash against the served store, so the
text cannot drift from what works; the other tests check each step's result.
"""

from __future__ import annotations

import os
import subprocess
import sys

import blake3
import httpx
import pytest

from tests.support.docs import example
from tests.support.services import REPO_ROOT, free_port, stop_process, wait_for_port

CGSTORE = [sys.executable, "-m", "cgstore.cli"]


@pytest.fixture
def embedded_server(tmp_path):
    """``cgstore serve`` with nothing configured but a fresh CGSTORE_HOME and a free port."""
    port = free_port()
    env = {**os.environ, "CGSTORE_HOME": str(tmp_path / "home"), "CGSTORE_PORT": str(port)}
    for name in ("CGSTORE_DATABASE_URL", "CGSTORE_STORAGE_URL"):
        env.pop(name, None)
    proc = subprocess.Popen([*CGSTORE, "serve"], env=env, cwd=tmp_path)
    try:
        wait_for_port(port, proc=proc)
        yield f"http://127.0.0.1:{port}", env, tmp_path
    finally:
        stop_process(proc)


def curl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["curl", "-sS", *args], capture_output=True, check=True)


def test_the_readme_quick_start_runs_as_written(embedded_server):
    base_url, env, workdir = embedded_server
    script = example("quick-start").replace("http://127.0.0.1:8080", base_url)
    (workdir / ".venv").symlink_to(REPO_ROOT / ".venv")
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script], cwd=workdir, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["201", "identical"]  # the status the comment promises, shown
    assert not list(workdir.glob("*.pt2"))  # the blobs went to a temporary directory, not the checkout
    assert f"cgstore: using CGSTORE_HOME={(workdir / 'home').resolve()}" in done.stderr


def test_a_token_minted_under_another_home_is_refused_with_a_hint(embedded_server, tmp_path):
    """The CLI run from another directory makes another .cgstore: it says so, and the store's refusal points at it."""
    base_url, env, _ = embedded_server
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    stray_env = {k: v for k, v in env.items() if k != "CGSTORE_HOME"}
    minted = subprocess.run(
        [*CGSTORE, "token", "mint", "--sub", "alice", "--grant", "acme/*:read"],
        env=stray_env,
        cwd=elsewhere,
        capture_output=True,
        text=True,
        check=True,
    )
    assert f"CGSTORE_HOME={(elsewhere / '.cgstore').resolve()} (new here" in minted.stderr
    refused = httpx.get(
        f"{base_url}/v1/repos/acme/models/compiled-graphs", headers={"Authorization": f"Bearer {minted.stdout.strip()}"}
    )
    assert refused.status_code == 401
    assert "unknown key" in refused.text and "another CGSTORE_HOME" in refused.text


def test_quick_start_with_curl(embedded_server):
    base_url, env, workdir = embedded_server
    token = subprocess.run(
        [*CGSTORE, "token", "mint", "--sub", "alice", "--grant", "acme/*:read,write", "--ttl", "1h"],
        env=env,
        cwd=workdir,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    blob = workdir / "model.pt2"
    blob.write_bytes(os.urandom(1_000_000))
    digest = "blake3:" + blake3.blake3(blob.read_bytes()).hexdigest()

    put = curl(
        "-w",
        "%{http_code}",
        "-o",
        "/dev/null",
        "-H",
        f"Authorization: Bearer {token}",
        "-X",
        "PUT",
        "--data-binary",
        f"@{blob}",
        f"{base_url}/v1/repos/acme/models/blobs/{digest}",
    )
    assert put.stdout == b"201"
    out = workdir / "downloaded"
    curl(
        "-fL", "-o", str(out), "-H", f"Authorization: Bearer {token}", f"{base_url}/v1/repos/acme/models/blobs/{digest}"
    )
    assert out.read_bytes() == blob.read_bytes()
    # The embedded default lives entirely under CGSTORE_HOME.
    home = workdir / "home"
    assert (home / "cgstore.sqlite3").exists() and (home / "token-signing-key.pem").exists()
    assert httpx.get(f"{base_url}/readyz").status_code == 200


def test_token_mint_cli_refuses_a_bad_grant(tmp_path):
    env = {**os.environ, "CGSTORE_HOME": str(tmp_path)}
    result = subprocess.run(
        [*CGSTORE, "token", "mint", "--sub", "alice", "--grant", "acme/*"],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert "acme/*" in result.stderr and "Traceback" not in result.stderr


def test_db_upgrade_migrates_an_external_database_and_serve_refuses_a_stale_one(tmp_path):
    from cgstore.core import migrate
    from tests.support.services import postgres_database

    with postgres_database("cgstore_cli") as url:
        env = {
            **os.environ,
            "CGSTORE_HOME": str(tmp_path),
            "CGSTORE_DATABASE_URL": url,
            "CGSTORE_PORT": str(free_port()),
        }
        stale = subprocess.run([*CGSTORE, "serve"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert stale.returncode == 2 and "cgstore db upgrade" in stale.stderr
        subprocess.run([*CGSTORE, "db", "upgrade"], env=env, cwd=tmp_path, check=True, capture_output=True)
        assert migrate.is_current(url)


def test_token_mint_platform_registers_the_principal(tmp_path):
    from cgstore.core.db import Database
    from cgstore.owners.service import is_platform_principal
    from cgstore.repos.service import write_decision
    from cgstore.settings import Settings
    from cgstore.tokens.service import TokenService

    env = {**os.environ, "CGSTORE_HOME": str(tmp_path)}
    token = subprocess.run(
        [*CGSTORE, "token", "mint", "--sub", "platform-ci", "--platform", "--grant", "root/*:read,write"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    settings = Settings(home=tmp_path)
    service = TokenService(Database(settings.resolved_database_url), settings)
    claims = service.verify(token)
    assert claims.plt and claims.sub == "platform-ci"
    with service.db.session() as session:
        assert is_platform_principal(session, "platform-ci")
    with service.db.session() as session:  # raises unless the root gate opens
        write_decision(session, claims, "root", "family-flux").enforce()
