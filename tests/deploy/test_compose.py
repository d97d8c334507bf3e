"""docker-compose.yml and store/Dockerfile, checked against the code they configure.

There is no Docker engine here, so these tests read the files the way compose
and the image would use them: every ``CGSTORE_*`` variable must be a real
setting (pydantic-settings silently ignores unknown ones, so a typo would
never fail at run time), every command must parse as a ``cgstore`` CLI
command, images must be pinned, health checks must probe what the next
service needs (PostgreSQL over TCP), and the migration must retry. The ``metrics`` profile's Prometheus must scrape the
store with its metrics token, and every series the Grafana dashboard queries
must be one a running store exports, with the labels it has.
"""

from __future__ import annotations

import json
import re
import time

import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from cgstore.cli import app, parse_duration
from cgstore.core import migrate
from cgstore.core.metrics import Metrics
from cgstore.settings import Settings, parse_s3_url
from tests.support.services import REPO_ROOT, free_port

COMPOSE_FILE = REPO_ROOT / "docker-compose.yml"
DOCKERFILE = REPO_ROOT / "store" / "Dockerfile"
DOCKERIGNORE = REPO_ROOT / ".dockerignore"
DEPLOY = REPO_ROOT / "docs" / "deploy.md"
PROMETHEUS_CONFIG = REPO_ROOT / "deploy" / "prometheus" / "prometheus.yml"
GRAFANA = REPO_ROOT / "deploy" / "grafana"
DASHBOARD = GRAFANA / "cgstore.json"
METRICS_PROFILE = "metrics"
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


# -- the metrics profile: Prometheus and Grafana ---------------------------------------------

# A series name: the ``cgstore_`` prefix Prometheus identifiers carry, with digits and colons
# too, so that a made-up name is caught whole rather than cut at a character the store never uses.
_SERIES = re.compile(r"\bcgstore_[a-zA-Z0-9_:]+")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_MATCHERS = re.compile(r"\b(cgstore_[a-zA-Z0-9_:]+)\s*\{([^}]*)\}")
_MATCHER_LABEL = re.compile(r"(\w+)\s*(?:=~|!~|!=|=)")
_GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
# The series each family type exports, as Prometheus ingests the text format.
# (The text format announces a counter's or histogram's ``_created`` as a gauge family of its own.)
_SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}


def profile_services(services: dict) -> dict[str, dict]:
    return {name: svc for name, svc in services.items() if METRICS_PROFILE in svc.get("profiles", [])}


def mounts(service: dict) -> dict[str, str]:
    """Container path -> host path of the service's bind mounts, each required read-only."""
    binds = {}
    for volume in service.get("volumes", []):
        source, target, *mode = volume.split(":")
        if source.startswith("./"):
            assert mode == ["ro"], f"{volume} is not mounted read-only"
            binds[target] = source
    return binds


def declared_labels() -> dict[str, set[str]]:
    """Family name -> label names, from the store's own metrics (unused labelled metrics export no samples).

    ``_labelnames``: prometheus_client has no public accessor for a collector's declared labels.
    """
    metrics = Metrics()
    collectors = [value for value in vars(metrics).values() if isinstance(value, MetricWrapperBase)]
    return {family.name: set(collector._labelnames) for collector in collectors for family in collector.describe()}


def exported_series(scrape: str) -> dict[str, set[str]]:
    """Series name -> its label names, for every ``cgstore_`` family a scrape announces."""
    labels = declared_labels()
    series = {}
    for family in text_string_to_metric_families(scrape):
        if family.name.startswith("cgstore_"):
            own = labels[family.name if family.name in labels else family.name.removesuffix("_created")]
            for suffix in _SUFFIXES[family.type]:
                series[family.name + suffix] = own | ({"le"} if suffix == "_bucket" else set())
    return series


def dashboard_exprs(dashboard: dict) -> list[str]:
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]


def query_problems(expr: str, exported: dict[str, set[str]]) -> list[str]:
    """What in one PromQL expression names a series or label the store does not export."""
    bare = _STRING.sub('""', expr)  # label values are not names
    names = _SERIES.findall(bare)
    problems = [f"{name} is not exported" for name in names if name not in exported]
    if not names:
        problems.append(f"{expr!r} queries no cgstore series")
    known = [exported[name] for name in names if name in exported]
    for name, matchers in _MATCHERS.findall(bare):
        for label in _MATCHER_LABEL.findall(matchers):
            if label not in exported.get(name, set()):
                problems.append(f"{name} has no label {label}")
    available = set().union(*known) if known else set()
    for grouping in _GROUPING.findall(bare):
        for label in filter(None, (part.strip() for part in grouping.split(","))):
            if label not in available:
                problems.append(f"{expr!r} groups by {label}, which none of its series has")
    return problems


def dashboard_problems(dashboard: dict, exported: dict[str, set[str]]) -> list[str]:
    return [problem for expr in dashboard_exprs(dashboard) for problem in query_problems(expr, exported)]


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


@pytest.fixture
def scraped(store) -> dict[str, set[str]]:
    """The series a running store exports, after a request and a resolve gave its counters samples."""
    with store.client() as client:
        assert client.get("/healthz").status_code == 200
    token = store.mint("dashboard-check", "acme/*:read")
    with store.client(token) as client:
        response = client.post("/v1/compiled-graphs:resolve", json={"family": "f", "keys": ["ck1-" + "0" * 56]})
        assert response.status_code == 200, response.text
    return exported_series(store.scrape_metrics())


def test_the_dashboard_queries_only_series_the_store_exports(dashboard, scraped):
    assert {"cgstore_requests_total", "cgstore_request_seconds_bucket", "cgstore_upload_sessions_open"} <= set(scraped)
    assert dashboard_problems(dashboard, scraped) == []


def test_the_dashboard_shows_every_family_the_store_exports(dashboard):
    """A metric added to the store gets its panel."""
    queried = {name for expr in dashboard_exprs(dashboard) for name in _SERIES.findall(_STRING.sub('""', expr))}
    shown = {
        family for family in declared_labels() for name in queried if name.startswith(family + "_") or name == family
    }
    assert set(declared_labels()) - shown == set()


@pytest.mark.parametrize(
    ("expr", "problem"),
    [
        ("sum(rate(cgstore_resolve_hits_total[5m]))", "cgstore_resolve_hits_total is not exported"),
        ("histogram_quantile(0.99, rate(cgstore_request_seconds[5m]))", "cgstore_request_seconds is not exported"),
        ("rate(cgstore_bytes_in[5m])", "cgstore_bytes_in is not exported"),
        ("rate(cgstore_publish_total_count[5m])", "cgstore_publish_total_count is not exported"),
        ("rate(cgstore_2requests_total[5m])", "cgstore_2requests_total is not exported"),
        ('sum(rate(cgstore_publish_total{result="conflict"}[5m]))', "cgstore_publish_total has no label result"),
        ("sum by (tenant) (rate(cgstore_resolve_answers_total[5m]))", "groups by tenant"),
        ("sum by (le) (rate(cgstore_requests_total[5m]))", "groups by le"),
        ("up", "queries no cgstore series"),
    ],
)
def test_a_query_of_what_the_store_does_not_export_is_caught(expr, problem):
    """The check above is not vacuous: made-up names, wrong suffixes and labels fail it."""
    exported = exported_series(
        "\n".join(
            f"# TYPE {name} {kind}"
            for name, kind in [
                ("cgstore_requests_total", "counter"),
                ("cgstore_request_seconds", "histogram"),
                ("cgstore_bytes_in_total", "counter"),
                ("cgstore_publish_total", "counter"),
                ("cgstore_resolve_answers_total", "counter"),
            ]
        )
        + "\n"
    )
    problems = query_problems(expr, exported)
    assert any(problem in found for found in problems), problems


def test_the_dashboard_is_a_grafana_dashboard(dashboard):
    assert dashboard["uid"] and dashboard["title"] and isinstance(dashboard["schemaVersion"], int)
    assert dashboard["panels"]
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert panel["title"] and panel["type"] and set(panel["gridPos"]) == {"h", "w", "x", "y"}, panel
        assert panel["targets"], panel["title"]
        ref_ids = [target["refId"] for target in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)) and all(target["expr"] for target in panel["targets"])


def test_the_metrics_profile_is_prometheus_and_grafana(services):
    """Pinned like every pulled image (test_every_pulled_image_is_pinned covers them too)."""
    assert set(profile_services(services)) == {"prometheus", "grafana"}
    assert services["prometheus"]["image"].startswith("prom/prometheus:v")
    assert services["grafana"]["image"].startswith("grafana/grafana:")
    # The default `docker compose up -d --build` starts exactly what it did before.
    assert [name for name, svc in services.items() if "profiles" in svc] == ["prometheus", "grafana"]


def test_prometheus_scrapes_the_store_with_the_metrics_token(compose, services):
    prometheus = services["prometheus"]
    config_path = prometheus["command"][0].removeprefix("--config.file=")
    assert mounts(prometheus)[config_path] == "./" + str(PROMETHEUS_CONFIG.relative_to(REPO_ROOT))
    (job,) = yaml.safe_load(PROMETHEUS_CONFIG.read_text())["scrape_configs"]
    store_env = store_environment(services["store"])
    assert job.get("metrics_path", "/metrics") == "/metrics"
    assert job["static_configs"] == [{"targets": [f"store:{store_env['CGSTORE_PORT']}"]}]
    # The bearer is the secret file compose fills from the variable the store gets.
    assert job["authorization"]["type"] == "Bearer"
    (secret,) = prometheus["secrets"]
    assert job["authorization"]["credentials_file"] == f"/run/secrets/{secret}"
    assert compose["secrets"][secret] == {"environment": "CGSTORE_METRICS_TOKEN"}
    assert services["store"]["environment"]["CGSTORE_METRICS_TOKEN"] == "${CGSTORE_METRICS_TOKEN:-}"


def test_grafana_provisions_the_prometheus_datasource_and_the_dashboard(services, dashboard):
    grafana = mounts(services["grafana"])
    provisioning = "/etc/grafana/provisioning"
    assert grafana[f"{provisioning}/datasources"] == "./deploy/grafana/provisioning/datasources"
    assert grafana[f"{provisioning}/dashboards"] == "./deploy/grafana/provisioning/dashboards"
    (datasource,) = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())[
        "datasources"
    ]
    assert datasource["type"] == "prometheus"
    assert datasource["url"] == "http://prometheus:9090"
    assert "--web.listen-address" not in " ".join(services["prometheus"]["command"])  # so 9090 is right
    uids = {panel["datasource"]["uid"] for panel in dashboard["panels"]}
    uids |= {target["datasource"]["uid"] for panel in dashboard["panels"] for target in panel["targets"]}
    assert uids == {datasource["uid"]}
    (provider,) = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "cgstore.yml").read_text())["providers"]
    mounted_dashboard = {target: source for target, source in grafana.items() if source.endswith("cgstore.json")}
    assert mounted_dashboard == {f"{provider['options']['path']}/cgstore.json": "./deploy/grafana/cgstore.json"}


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
