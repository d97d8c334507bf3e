"""Real backing services for tests and benchmarks: PostgreSQL, S3 (Ceph's RADOS Gateway), a store.

Tests and ``bench/`` scripts start what they need through these helpers and
stop what they started. PostgreSQL is the machine's own cluster (started if it
is down); each run creates its own database and drops only that one.
S3 is a real implementation: a single-host Ceph cluster started for the session
(``rgw_s3_server``), its RADOS Gateway on a free loopback port, reached through
real boto3 over HTTP and signed with its own user's keys.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

PG_ADMIN_URL = os.environ.get("CGSTORE_TEST_PG_ADMIN", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
REPO_ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, timeout_s: float = 30.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening on {port}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout_s}s")


def stop_process(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# -- PostgreSQL ---------------------------------------------------------------


def postgres_is_up() -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", 5432), timeout=1):
        return True
    return False


def ensure_postgres() -> None:
    """Start the machine's PostgreSQL cluster if it is not answering."""
    if postgres_is_up():
        return
    versions = sorted(os.listdir("/etc/postgresql"))
    subprocess.run(["pg_ctlcluster", "--skip-systemctl-redirect", versions[-1], "main", "start"], check=True)
    wait_for_port(5432, timeout_s=60)


@contextlib.contextmanager
def postgres_database(prefix: str = "cgstore_test", options: str = "") -> Iterator[str]:
    """Create a fresh database (``CREATE DATABASE … options``), yield its SQLAlchemy URL, drop it (only it) afterwards."""
    from sqlalchemy import create_engine, text

    ensure_postgres()
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}" {options}'))
    try:
        yield PG_ADMIN_URL.rsplit("/", 1)[0] + "/" + name
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


# -- S3 -----------------------------------------------------------------------------


@dataclass
class S3Server:
    """An S3 endpoint on loopback and the keys of its user; ``processes`` are what serve it."""

    endpoint_url: str
    processes: list[subprocess.Popen]
    access_key: str
    secret_key: str
    region: str = "us-east-1"
    implementation: str = "rgw"

    @property
    def endpoint(self) -> str:
        return self.endpoint_url

    @property
    def process(self) -> subprocess.Popen:
        """The process answering HTTP (``radosgw``)."""
        return self.processes[-1]

    @property
    def pids(self) -> dict[str, int]:
        """Every process of the server by name, for RSS and CPU sampling."""
        return {f"{self.implementation}:{Path(str(proc.args[0])).name}": proc.pid for proc in self.processes}

    @property
    def credentials(self) -> dict[str, str]:
        """The ``AWS_*`` variables a store (in-process or not) signs its requests with."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
        }

    def client(self, **config):
        """A boto3 client of its own, signed with this server's keys (``config``: botocore ``Config`` options)."""
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name=self.region,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            # RGW 16 knows no flexible checksums (the CRC32 boto3 ≥ 1.36 sends by default).
            config=Config(
                s3={"addressing_style": "path"},
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
                **config,
            ),
        )

    def create_bucket(self, name: str | None = None) -> str:
        name = name or f"cgstore-{uuid.uuid4().hex[:10]}"
        self.client().create_bucket(Bucket=name)
        return name

    def storage_url(self, bucket: str) -> str:
        return f"s3://{bucket}?endpoint_url={self.endpoint_url}&region={self.region}"


def use_s3_credentials(server: S3Server) -> None:
    """boto3 in this process (stores under test, and the processes it starts) signs with ``server``'s keys."""
    os.environ.update(server.credentials)


# -- S3 (Ceph's RADOS Gateway) ------------------------------------------------------
#
# A single-host Ceph cluster under a temporary directory: one monitor, one BlueStore
# OSD on a sparse file, radosgw's beast frontend on a loopback port, and one S3 user.
# Facts that cost time bringing it up (Ceph 16.2):
# - the monmap carries both the v2 and the v1 address, or the OSD hangs at boot;
# - cephx is off inside the cluster, and then radosgw needs `ms mon client mode =
#   crc secure` or it loops on auth error -13 (SigV4 is still enforced on S3 requests);
# - without a mgr nothing marks an OSD full: the block is sized for the benchmarks
#   (sparse, so only what is written takes disk), RGW's garbage collector runs every
#   few seconds, and the free space is checked first;
# - the monitor's `mon data avail crit` is lowered so a fuller shared disk doesn't stop it.

CEPH_PACKAGES = ("radosgw", "ceph-mon", "ceph-osd", "ceph-common")
RGW_BLOCK_BYTES = int(os.environ.get("CGSTORE_TEST_RGW_BLOCK_GIB", "24")) << 30
# Disk left to everything else on the machine after the sparse block is full.
RGW_DISK_RESERVE_BYTES = 8 << 30
RGW_READY_TIMEOUT_S = 120.0


def ceph_installed() -> bool:
    return all(shutil.which(tool) for tool in ("ceph-mon", "ceph-osd", "radosgw", "radosgw-admin", "monmaptool"))


def _ceph_conf(root: Path, fsid: str, mon_v2: int, mon_v1: int, rgw_port: int, block_bytes: int) -> str:
    return f"""[global]
fsid = {fsid}
mon host = [v2:127.0.0.1:{mon_v2},v1:127.0.0.1:{mon_v1}]
mon initial members = a
public network = 127.0.0.0/8
auth cluster required = none
auth service required = none
auth client required = none
run dir = {root}/run
admin socket = {root}/run/$name.$pid.asok
log file = {root}/log/$name.log
log to stderr = false
err to stderr = false
mon cluster log file = {root}/log/cluster.log
crash dir = {root}/crash
keyring = {root}/keyring
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
osd crush chooseleaf type = 0
mon allow pool size one = true
mon warn on pool no redundancy = false
mon data avail warn = 2
mon data avail crit = 1
mon max pg per osd = 1000

[mon.a]
mon data = {root}/mon
mon addr = [v2:127.0.0.1:{mon_v2},v1:127.0.0.1:{mon_v1}]

[osd.0]
osd data = {root}/osd
osd objectstore = bluestore
bluestore block path = {root}/osd-block
bluestore block create = true
bluestore block size = {block_bytes}
bluestore block db create = false
bluestore block wal create = false
bluestore fsck on mkfs = false
osd memory target = {768 << 20}
osd op num shards = 2
osd op num threads per shard = 1

[client.rgw.a]
rgw data = {root}/rgw
rgw frontends = beast endpoint=127.0.0.1:{rgw_port}
ms mon client mode = crc secure
rgw thread pool size = 64
rgw gc obj min wait = 5
rgw gc processor period = 5
rgw gc processor max time = 5
"""


def _run_ceph(args: list[str], conf: Path, timeout_s: float = 60.0) -> str:
    done = subprocess.run([*args, "-c", str(conf)], capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return done.stdout


def _wait_for(condition, what: str, timeout_s: float, procs: list[subprocess.Popen], logs: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        for proc in procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode} while waiting for {what}; see {logs}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"Ceph: no {what} after {timeout_s}s; see {logs}")
        time.sleep(0.2)


def _osd_is_up(conf: Path) -> bool:
    with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
        return '"num_up_osds":1' in _run_ceph(["ceph", "osd", "stat", "-f", "json"], conf, 10).replace(" ", "")
    return False


def _s3_answers(endpoint_url: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(endpoint_url, timeout=2).status_code < 500
    return False


@contextlib.contextmanager
def rgw_s3_server(block_bytes: int = RGW_BLOCK_BYTES) -> Iterator[S3Server]:
    """A single-host Ceph cluster with radosgw on a free loopback port, for the duration of the block.

    Everything lives under one temporary directory (removed after); its daemons are
    stopped by their pids. Ready in about 13 s; about 600 MiB of RSS.
    """
    if not ceph_installed():
        raise RuntimeError("Ceph is not installed: `make ceph` (as root) installs " + " ".join(CEPH_PACKAGES))
    root = Path(tempfile.mkdtemp(prefix="cgstore-ceph-"))
    free = shutil.disk_usage(root).free
    block_bytes = min(block_bytes, free - RGW_DISK_RESERVE_BYTES)
    if block_bytes < 4 << 30:
        shutil.rmtree(root, ignore_errors=True)
        raise RuntimeError(f"only {free >> 30} GiB free under {root.parent}: too little for a Ceph OSD")
    for sub in ("run", "log", "crash", "mon", "osd", "rgw"):
        (root / sub).mkdir()
    mon_v2, mon_v1, rgw_port = free_port(), free_port(), free_port()
    conf = root / "ceph.conf"
    fsid = str(uuid.uuid4())
    conf.write_text(_ceph_conf(root, fsid, mon_v2, mon_v1, rgw_port, block_bytes))
    logs = root / "log"
    procs: list[subprocess.Popen] = []

    def daemon(*args: str) -> subprocess.Popen:
        with open(logs / f"{Path(args[0]).name}.stderr", "wb") as stderr:  # the child keeps its own copy
            proc = subprocess.Popen([*args, "-f", "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=stderr)
        procs.append(proc)
        return proc

    try:
        _run_ceph(
            [
                "monmaptool",
                "--create",
                "--fsid",
                fsid,
                "--addv",
                "a",
                f"[v2:127.0.0.1:{mon_v2},v1:127.0.0.1:{mon_v1}]",
                str(root / "monmap"),
            ],
            conf,
        )
        _run_ceph(
            [
                "ceph-authtool",
                "--create-keyring",
                str(root / "keyring"),
                "--gen-key",
                "-n",
                "mon.",
                "--cap",
                "mon",
                "allow *",
            ],
            conf,
        )
        _run_ceph(["ceph-mon", "--mkfs", "-i", "a", "--monmap", str(root / "monmap")], conf)
        daemon("ceph-mon", "-i", "a")
        osd_uuid = str(uuid.uuid4())
        osd_id = _run_ceph(["ceph", "osd", "new", osd_uuid], conf, RGW_READY_TIMEOUT_S).strip()
        _run_ceph(["ceph-osd", "-i", osd_id, "--mkfs", "--osd-uuid", osd_uuid], conf, RGW_READY_TIMEOUT_S)
        daemon("ceph-osd", "-i", osd_id)
        _wait_for(lambda: _osd_is_up(conf), "OSD up", RGW_READY_TIMEOUT_S, procs, logs)
        daemon("radosgw", "-n", "client.rgw.a")
        endpoint_url = f"http://127.0.0.1:{rgw_port}"
        _wait_for(lambda: _s3_answers(endpoint_url), "radosgw answering", RGW_READY_TIMEOUT_S, procs, logs)
        access_key, secret_key = secrets.token_hex(10).upper(), secrets.token_urlsafe(30)
        _run_ceph(
            [
                "radosgw-admin",
                "-n",
                "client.rgw.a",
                "user",
                "create",
                "--uid",
                "cgstore",
                "--display-name",
                "cgstore tests",
                "--access-key",
                access_key,
                "--secret-key",
                secret_key,
            ],
            conf,
        )
        server = S3Server(endpoint_url, procs, access_key, secret_key, implementation="rgw")
        _warm_up(server)
        yield server
    finally:
        for proc in reversed(procs):
            stop_process(proc, timeout_s=20)
        if not os.environ.get("CGSTORE_TEST_KEEP_CEPH"):  # its logs, to debug a bring-up
            shutil.rmtree(root, ignore_errors=True)


def _warm_up(server: S3Server) -> None:
    """Write once, plainly and by multipart: RGW creates its data pools on the first such
    writes (seconds, long enough to time out a connection), here rather than in a test or a timed run."""
    client, bucket = server.client(), server.create_bucket("cgstore-warm-up")
    client.put_object(Bucket=bucket, Key="plain", Body=b"warm")
    upload = client.create_multipart_upload(Bucket=bucket, Key="multipart")["UploadId"]
    part = client.upload_part(Bucket=bucket, Key="multipart", UploadId=upload, PartNumber=1, Body=b"warm")
    client.complete_multipart_upload(
        Bucket=bucket,
        Key="multipart",
        UploadId=upload,
        MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": part["ETag"]}]},
    )
    client.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": "plain"}, {"Key": "multipart"}]})
    client.delete_bucket(Bucket=bucket)


def ceph_version() -> str:
    """``radosgw --version``'s number (``16.2.15``), or "" when Ceph is not installed."""
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        out = subprocess.run(["radosgw", "--version"], capture_output=True, text=True, check=True).stdout
        return out.split()[2]
    return ""


# -- the store as a separate process ----------------------------------------------


@dataclass
class StoreProcess:
    base_url: str
    process: subprocess.Popen
    env: dict


@contextlib.contextmanager
def store_process(env: dict[str, str], home: Path) -> Iterator[StoreProcess]:
    """Migrate and run ``cgstore serve`` in its own process (benchmarks, kill tests)."""
    port = free_port()
    full_env = {
        **os.environ,
        **env,
        "CGSTORE_HOME": str(home),
        "CGSTORE_HOST": "127.0.0.1",
        "CGSTORE_PORT": str(port),
        "CGSTORE_LOG_LEVEL": "warning",
    }
    cli = [sys.executable, "-m", "cgstore.cli"]
    subprocess.run([*cli, "db", "upgrade"], env=full_env, check=True, cwd=REPO_ROOT)
    proc = subprocess.Popen([*cli, "serve"], env=full_env, cwd=REPO_ROOT)
    try:
        wait_for_port(port, proc=proc)
        base_url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while httpx.get(f"{base_url}/readyz").status_code != 200:
            if time.monotonic() > deadline:
                raise TimeoutError("store never became ready")
            time.sleep(0.1)
        yield StoreProcess(base_url=base_url, process=proc, env=full_env)
    finally:
        stop_process(proc)
