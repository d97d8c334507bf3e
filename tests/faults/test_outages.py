"""Dependencies going down under a running store: 503 while down, recovery without a restart.

PostgreSQL is stopped for real (``pg_ctl -m immediate`` on the suite's private
cluster); S3 disappears behind its door. While a dependency is down every
request that needs it answers 503 ``UNAVAILABLE`` with ``Retry-After``; when it
returns the same process serves again by itself; afterwards the invariant
checker finds nothing half-written.
"""

from __future__ import annotations

import httpx
import pytest

from tests.faults.conftest import blob_of, unique_bytes
from tests.support.faults import wait_until_ready
from tests.support.services import store_process

pytestmark = pytest.mark.slow


def _assert_unavailable(response: httpx.Response) -> None:
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "UNAVAILABLE"
    assert int(response.headers["Retry-After"]) > 0


def _put(client: httpx.Client, repo: str, data: bytes) -> httpx.Response:
    return client.put(f"/v1/repos/acme/{repo}/blobs/{blob_of(data)}", content=data)


_CHECK = {"postgres": "database", "s3": "storage"}


@pytest.mark.parametrize("dependency", ["postgres", "s3"])
def test_a_stopped_dependency_answers_503_and_recovers_by_itself(world, dependency):
    token = world.token("faults-outage", "acme/*:read,write")
    before, during = unique_bytes(f"{dependency}-before"), unique_bytes(f"{dependency}-during")
    stopped = world.pg if dependency == "postgres" else world.s3
    with store_process(world.env, world.home) as store:
        headers = {"Authorization": f"Bearer {token}"}
        with httpx.Client(base_url=store.base_url, headers=headers, timeout=60) as client:
            assert _put(client, "outage", before).status_code == 201
            stopped.stop()
            try:
                ready = httpx.get(f"{store.base_url}/readyz", timeout=60)
                assert ready.status_code == 503 and ready.json()["status"] == "unavailable"
                assert ready.json()["checks"][_CHECK[dependency]] != "ok"
                _assert_unavailable(_put(client, "outage", during))
                _assert_unavailable(client.get(f"/v1/repos/acme/outage/blobs/{blob_of(before)}"))
                assert httpx.get(f"{store.base_url}/healthz").status_code == 200
            finally:
                stopped.start()
            wait_until_ready(store.base_url)
            # The same process, no restart: the refused write now lands, the earlier blob is whole.
            assert store.process.poll() is None
            assert _put(client, "outage", during).status_code == 201
            got = client.get(f"/v1/repos/acme/outage/blobs/{blob_of(before)}")
            assert got.status_code == 200 and got.content == before
    world.assert_invariants()


def test_postgres_stopped_mid_chunked_upload_resumes_from_the_committed_offset(world):
    token = world.token("faults-outage", "acme/*:read,write")
    data = unique_bytes("pg-mid-session", 3 * 4096)
    with store_process(world.env, world.home) as store:
        headers = {"Authorization": f"Bearer {token}"}
        with httpx.Client(base_url=store.base_url, headers=headers, timeout=60) as client:
            location = client.post("/v1/repos/acme/sessions/uploads").headers["Location"]
            first = client.patch(location, content=data[:4096], headers={"Content-Range": "0-4095"})
            assert first.status_code == 202
            world.pg.stop()
            try:
                _assert_unavailable(
                    client.patch(location, content=data[4096:8192], headers={"Content-Range": "4096-8191"})
                )
            finally:
                world.pg.start()
            wait_until_ready(store.base_url)
            status = client.get(location)
            assert status.status_code == 204 and status.headers["Upload-Offset"] == "4096"
            assert (
                client.patch(location, content=data[4096:8192], headers={"Content-Range": "4096-8191"}).status_code
                == 202
            )
            done = client.put(location, params={"digest": blob_of(data)}, content=data[8192:])
            assert done.status_code == 201, done.text
            assert client.get(f"/v1/repos/acme/sessions/blobs/{blob_of(data)}").content == data
    world.assert_invariants()
