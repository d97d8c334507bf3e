"""docker-compose.yml and store/Dockerfile, checked against the code they configure.

There is no Docker engine here, so these tests read the files the way compose
and the image would use them: every ``CGSTORE_*`` variable must be a real
setting (pydantic-settings silently ignores unknown ones, so a typo would
never fail at run time), every command must parse as a ``cgstore`` CLI
command, images must be pinned, health checks must probe what the next
service needs (PostgreSQL over TCP), and the migration must retry.
"""

from __future__ import annotations

import json
import re
import time

import pytest
import yaml
from typer.testing import CliRunner

from cgstore.cli import app, parse_duration
from cgstore.core import migrate
from cgstore.settings import Settings, parse_s3_url
from tests.support.services import REPO_ROOT, free_port

COMPOSE_FILE = REPO_ROOT / "docker-compose.yml"
DOCKERFILE = REPO_ROOT / "store" / "Dockerfile"
DOCKERIGNORE = REPO_ROOT / ".dockerignore"
DEPLOY = REPO_ROOT / "docs" / "deploy.md"
LOCAL_IMAGE = "cgstore:local"
_INTERPOLATION = re.compile(r"\$\{(\w+)(?::-([^}]*))?\}")


def interpolate(value: str) -> str:
    """Compose's ``${VAR:-default}`` with nothing set: the default (``${VAR}`` alone is refused)."""

    def default(match: re.Match) -> str:
        assert match.group(2) is not None, f"{match.group(0)} has no default: the first `up` would need it set"
        return match.group(2)

    return _INTERPOLATION.sub(default, value)


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())


@pytest.fixture(scope="module")
def services(compose) -> dict:
    return compose["services"]


def known_variables() -> set[str]:
    names = {f"CGSTORE_{name.upper()}" for name in Settings.model_fields}
    return names | {migrate.MIGRATIONS_DIR_ENV}


def dockerfile_env() -> dict[str, str]:
    """``ENV A=1 \\ B=2`` lines of the Dockerfile."""
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    env = {}
    for line in text.splitlines():
        if line.startswith("ENV "):
            env.update(pair.split("=", 1) for pair in line.removeprefix("ENV ").split())
    return env


def dockerfile_json_instruction(keyword: str) -> list[str]:
    (line,) = [line for line in DOCKERFILE.read_text().splitlines() if line.startswith(f"{keyword} ")]
    return json.loads(line.removeprefix(f"{keyword} "))


def store_environment(service: dict) -> dict[str, str]:
    return {key: interpolate(str(value)) for key, value in service.get("environment", {}).items()}


def cgstore_services(services: dict) -> dict[str, dict]:
    return {name: svc for name, svc in services.items() if svc.get("image") == LOCAL_IMAGE}


def assert_cli_accepts(argv: list[str]) -> None:
    """``argv`` names a real ``cgstore`` command with options it takes (parsed, not run)."""
    assert argv[0] == "cgstore", argv
    result = CliRunner().invoke(app, [*argv[1:], "--help"])
    assert result.exit_code == 0, f"{argv}: {result.output}"


# -- variables ----------------------------------------------------------------------

def test_every_cgstore_variable_is_a_real_setting(services):
    named = {key for svc in services.values() for key in svc.get("environment", {}) if key.startswith("CGSTORE_")}
    named |= {key for key in dockerfile_env() if key.startswith("CGSTORE_")}
    assert named, "the files configure nothing?"
    assert named - known_variables() == set()


def test_every_cgstore_variable_is_in_the_configuration_table(services):
    documented = set(re.findall(r"^\| `(CGSTORE_\w+)`", DEPLOY.read_text(), re.MULTILINE))
    assert known_variables() - documented == set()


def test_the_store_environment_parses_as_the_production_configuration(services, monkeypatch):
    for name in list(__import__("os").environ):
        if name.startswith("CGSTORE_"):
            monkeypatch.delenv(name)
    env = {**dockerfile_env(), **store_environment(services["store"])}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    settings = Settings()
    assert settings.resolved_database_url.startswith("postgresql+psycopg://")
    assert "@postgres:5432/" in settings.resolved_database_url
    assert settings.storage_is_s3
    bucket, endpoint, region = parse_s3_url(settings.resolved_storage_url)
    assert (bucket, endpoint, region) == ("cgstore", "http://minio:9000", "us-east-1")
    # Presigned URLs must name a host that clients can follow, not the compose network's.
    assert settings.s3_public_endpoint_url == "http://localhost:9000"
    assert (settings.host, settings.port, str(settings.home)) == ("0.0.0.0", 8080, "/data")


def test_migration_and_store_share_one_configuration(services):
    assert store_environment(services["migrate"]) == store_environment(services["store"])


# -- commands ---------------------------------------------------------------------

def test_service_commands_are_cgstore_commands(services):
    commands = {name: svc["command"] for name, svc in cgstore_services(services).items()}
    assert set(commands) == {"migrate", "store"}
    for argv in commands.values():
        assert_cli_accepts(argv)


def test_dockerfile_cmd_is_a_cgstore_command():
    assert_cli_accepts(dockerfile_json_instruction("CMD"))


def test_an_unknown_option_would_be_caught():
    """The check above is not vacuous: a misspelt option or command fails it."""
    with pytest.raises(AssertionError):
        assert_cli_accepts(["cgstore", "db", "upgrade", "--wiat", "60s"])
    with pytest.raises(AssertionError):
        assert_cli_accepts(["cgstore", "srve"])


def test_the_migration_retries_for_a_bounded_time(services):
    argv = services["migrate"]["command"]
    wait = argv[argv.index("--wait") + 1]
    assert 10 <= parse_duration(wait) <= 600
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert services["store"]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"


# -- images and health ----------------------------------------------------------------

def test_the_store_image_is_built_once_and_shared(services):
    builders = [name for name, svc in services.items() if "build" in svc]
    assert builders == ["migrate"]
    assert services["migrate"]["image"] == LOCAL_IMAGE
    assert services["migrate"]["build"]["dockerfile"] == "store/Dockerfile"
    assert services["store"]["image"] == LOCAL_IMAGE


def test_every_pulled_image_is_pinned(services):
    for name, svc in services.items():
        if svc["image"] == LOCAL_IMAGE:
            continue
        repository, _, tag = svc["image"].rpartition(":")
        assert repository and "/" not in tag, f"{name}: {svc['image']} has no tag"
        assert tag != "latest" and re.search(r"\d", tag), f"{name}: {svc['image']} is not pinned"
        # A major version alone (postgres:16) still moves under us.
        assert re.search(r"\d[.-]\d", tag), f"{name}: {svc['image']} pins no exact release"


def test_postgres_health_is_probed_over_tcp(services):
    probe = services["postgres"]["healthcheck"]["test"]
    assert "pg_isready" in probe
    assert probe[probe.index("-h") + 1] == "127.0.0.1"


def test_every_awaited_health_has_a_healthcheck(services):
    for svc in services.values():
        for dependency, how in svc.get("depends_on", {}).items():
            if how["condition"] == "service_healthy":
                assert "healthcheck" in services[dependency], dependency
            elif how["condition"] == "service_completed_successfully":
                assert services[dependency]["restart"] == "no", dependency


# -- S3 credentials ------------------------------------------------------------------

def test_the_store_uses_its_own_minio_user_not_the_root(services):
    store_env = store_environment(services["store"])
    minio_env = {key: interpolate(str(value)) for key, value in services["minio"]["environment"].items()}
    access_key, secret = store_env["AWS_ACCESS_KEY_ID"], store_env["AWS_SECRET_ACCESS_KEY"]
    assert access_key != minio_env["MINIO_ROOT_USER"]
    assert secret != minio_env["MINIO_ROOT_PASSWORD"]
    script = interpolate(services["minio-init"]["command"][0])
    bucket = parse_s3_url(store_env["CGSTORE_STORAGE_URL"])[0]
    assert f"mc mb --ignore-existing local/{bucket}" in script
    assert f"mc admin user add local {access_key} '{secret}'" in script
    assert f"--user {access_key}" in script
    assert f"arn:aws:s3:::{bucket}/*" in script
    assert services["store"]["depends_on"]["minio-init"]["condition"] == "service_completed_successfully"


# -- build context and docs --------------------------------------------------------------

def test_dockerignore_keeps_local_state_out_and_the_sources_in():
    ignored = {line.strip() for line in DOCKERIGNORE.read_text().splitlines() if line.strip() and line[0] != "#"}
    assert {".git", ".venv", ".test-cache", ".cgstore"} <= ignored
    for instruction in DOCKERFILE.read_text().splitlines():
        if instruction.startswith("COPY "):
            for source in instruction.split()[1:-1]:
                assert source.rstrip("/") not in ignored, source


def test_the_deploy_page_and_compose_file_agree_on_how_to_start():
    def up_commands(text: str) -> set[str]:
        return {" ".join(m.split()) for m in re.findall(r"docker compose up[^\n#`]*", text)}

    from_docs, from_compose = up_commands(DEPLOY.read_text()), up_commands(COMPOSE_FILE.read_text())
    assert from_docs == from_compose == {"docker compose up -d --build"}


# -- the retry itself -------------------------------------------------------------------

def test_db_upgrade_wait_gives_up_after_its_bound(monkeypatch):
    monkeypatch.setenv("CGSTORE_DATABASE_URL", f"postgresql+psycopg://nobody@127.0.0.1:{free_port()}/none")
    started = time.monotonic()
    result = CliRunner().invoke(app, ["db", "upgrade", "--wait", "2s"])
    elapsed = time.monotonic() - started
    assert result.exit_code == 2, result.output
    assert "did not answer within 2s" in result.output
    assert 1.0 <= elapsed < 15


def test_db_upgrade_wait_migrates_once_the_database_answers(monkeypatch, pg_url):
    monkeypatch.setenv("CGSTORE_DATABASE_URL", pg_url)
    result = CliRunner().invoke(app, ["db", "upgrade", "--wait", "30s"])
    assert result.exit_code == 0, result.output
    assert migrate.is_current(pg_url)
