"""``CGSTORE_WORKERS``: ``cgstore serve`` runs that many server processes on one port, all serving the same store."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import psutil

from tests.blobs.test_blobs_api import digest_of
from tests.support.services import REPO_ROOT, store_process


def test_two_workers_serve_one_store_and_stop_with_the_server(tmp_path):
    with store_process({"CGSTORE_WORKERS": "2"}, tmp_path / "home") as served:
        parent = psutil.Process(served.process.pid)
        # uvicorn's workers are multiprocessing-spawned children (not its resource tracker).
        workers = [child for child in parent.children() if "spawn_main" in " ".join(child.cmdline())]
        assert len(workers) == 2, [child.cmdline() for child in parent.children()]
        token = subprocess.run(
            [sys.executable, "-m", "cgstore.cli", "token", "mint", "--sub", "alice", "--grant", "acme/*:read,write"],
            env=served.env,
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        data = os.urandom(4096)
        headers = {"Authorization": f"Bearer {token}"}
        with httpx.Client(base_url=served.base_url, headers=headers) as client:
            assert client.put(f"/v1/repos/acme/w/blobs/{digest_of(data)}", content=data).status_code == 201
        # A fresh connection per request: the kernel spreads them over the workers,
        # and every one verifies the token and finds the blob the other wrote.
        for _ in range(12):
            response = httpx.get(f"{served.base_url}/v1/repos/acme/w/blobs/{digest_of(data)}", headers=headers)
            assert response.status_code == 200 and response.content == data
    assert not any(worker.is_running() and worker.status() != psutil.STATUS_ZOMBIE for worker in workers)
