"""The image built from the real Dockerfile and run by a real OCI engine (podman here and in CI):
`make container-test`, which first builds the Dockerfile's base locally (tests/container/base.sh;
registries are unreachable) and the docker-compose v1 client. CPU only: the image is the CUDA one,
and torch runs it on the CPU when no GPU is passed in.

What a user does, in order: make the folders as themselves, train, train again (resume), stop the
container (exit 75 with a checkpoint of that step), run as a uid the image does not know, and
`make compose-up` twice (the second resumes)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, TEST_DATA_ENV, free_port, make_jpegs

from trainer.contract import EXIT_PREEMPTED

pytestmark = pytest.mark.container

ENGINE = os.environ.get("ENGINE", "podman")
os.environ.setdefault("CONTAINERS_CONF", str(ROOT / "tests" / "container" / "containers.conf"))
IMAGE = "localhost/cluster-trainer:container-test"
CA = "/etc/ssl/certs/ca-certificates.crt"
COMPOSE_V1 = ROOT / ".venv-compose-v1" / "bin" / "docker-compose"
USER = 1000
# 2,048 real training images on 2 CPU processes: 32 steps an epoch, about a second each
SMALL = {
    "model": {"name": "tinynet"},
    "data": {"train_subset": 2048, "test_subset": 512},
    "train": {"batch_size": 64, "log_every": 8, "epochs": 1},
}


def sh(cmd: list[str], timeout: float = 600, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


def as_user(cmd: list[str]) -> list[str]:
    return ["setpriv", f"--reuid={USER}", f"--regid={USER}", "--clear-groups", *cmd]


def done(ck: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in ck.glob("step-*") if (p / "meta.json").exists())


@pytest.fixture(scope="module")
def image() -> str:
    # the real Dockerfile, unchanged; pip needs the host's CA bundle mounted, never baked in
    p = sh([ENGINE, "build", "--pull=never", "-v", f"{CA}:{CA}:ro", "-t", IMAGE, "."], timeout=1200, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return IMAGE


@pytest.fixture
def host():
    # the working folder of a user with uid 1000 (pytest's tmp_path is root's, mode 0700)
    d = Path(tempfile.mkdtemp(prefix="container-test-", dir="/tmp"))
    d.chmod(0o755)
    os.chown(d, USER, USER)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def data() -> Path:
    """$TRAINER_TEST_DATA (CI: the real data set), else JPEGs made once, readable by the container's user."""
    if os.environ.get(TEST_DATA_ENV):
        return Path(os.environ[TEST_DATA_ENV])
    folder = Path(tempfile.gettempdir()) / "container-test-jpegs"
    if not (folder / "test").is_dir():
        make_jpegs(folder)
        for p in [folder, *folder.rglob("*")]:
            p.chmod(0o755 if p.is_dir() else 0o644)
    return folder


def docker_run(
    image: str, ck: Path, *args: str, user: str = f"{USER}:{USER}", extra: tuple[str, ...] = ()
) -> list[str]:
    # the README's `docker run`, on the CPU, with the CIFAR-10 JPEGs as /data
    return [
        ENGINE,
        "run",
        "--shm-size",
        "1g",
        "-u",
        user,
        *extra,
        "-v",
        f"{data()}:/data:ro",
        "-v",
        f"{ck}:/checkpoints",
        image,
        "--config",
        "configs/smoke.yaml",
        "data.name=imagefolder",
        "model.name=tinynet",
        "data.train_subset=2048",
        "data.test_subset=512",
        *args,
    ]


def test_folders_made_as_the_caller_train_resume_and_a_stop_gives_75(image, host):
    ck = host / "checkpoints"
    assert sh(as_user(["mkdir", "-p", str(ck)])).returncode == 0  # the README's `mkdir -p`, as that user

    first = sh(docker_run(image, ck, "train.epochs=1"), timeout=300)
    out = first.stdout + first.stderr
    assert first.returncode == 0 and "starting fresh" in out, out[-3000:]
    assert done(ck) == [32] and (ck / "step-32").stat().st_uid == USER  # written as the caller

    second = sh(docker_run(image, ck, "train.epochs=2"), timeout=300)
    out = second.stdout + second.stderr
    assert second.returncode == 0 and "resuming from /checkpoints/step-32" in out, out[-3000:]
    assert 64 in done(ck)

    name = f"container-test-stop-{os.getpid()}"
    started = sh(docker_run(image, ck, "train.epochs=60", "train.log_every=4", extra=("-d", "--name", name)))
    assert started.returncode == 0, started.stderr
    try:
        deadline, logs = time.monotonic() + 240, ""
        while time.monotonic() < deadline and "epoch 5/60" not in logs:
            time.sleep(1)
            p = sh([ENGINE, "logs", name])
            logs = p.stdout + p.stderr
        assert "epoch 5/60" in logs, logs[-3000:]
        stop = sh([ENGINE, "stop", "-t", "60", name], timeout=120)  # SIGTERM to PID 1, `trainer launch`
        assert stop.returncode == 0, stop.stderr
        code = sh([ENGINE, "inspect", "--format", "{{.State.ExitCode}}", name]).stdout.strip()
        p = sh([ENGINE, "logs", name])
        logs = p.stdout + p.stderr
        assert code == str(EXIT_PREEMPTED), logs[-3000:]
        step = int(re.search(r"stopped by SIGTERM at step (\d+); checkpoint saved", logs).group(1))
        assert step > 64 and step in done(ck), (step, done(ck))
    finally:
        sh([ENGINE, "rm", "-f", name])


def test_a_folder_the_engine_made_as_root_gets_one_line_naming_the_fix(image, host):
    # what `docker run -v ./checkpoints:/checkpoints` does when ./checkpoints does not exist yet
    ck = host / "checkpoints"
    ck.mkdir()  # root's, as the engine makes it
    p = sh(docker_run(image, ck, "train.epochs=1"), timeout=300)
    lines = [line for line in (p.stdout + p.stderr).splitlines() if line.startswith("error:")]
    assert p.returncode == 2 and len(lines) == 1, p.stdout[-2000:] + p.stderr[-2000:]
    assert "/checkpoints belongs to uid 0, this process runs as uid 1000" in lines[0] and "mkdir -p" in lines[0], lines
    assert list(ck.iterdir()) == []  # nothing written


def test_a_uid_with_no_passwd_entry_and_no_writable_home_trains(image, host):
    # OpenShift and `user:` overrides: a uid the image does not know, group 0, HOME=/ (not writable)
    ck = host / "checkpoints"
    ck.mkdir()
    os.chown(ck, 54321, 0)
    p = sh(
        docker_run(
            image, ck, "train.epochs=1", "train.plot=true", user="54321:0", extra=("--passwd=false", "-e", "HOME=/")
        ),
        timeout=300,
    )
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    assert (ck / "curves.png").stat().st_size > 0 and done(ck) == [32]
    # matplotlib (and the compile caches) found a writable HOME: no per-rank temporary cache warnings
    assert "Matplotlib created a temporary" not in out and "Permission denied" not in out, out[-3000:]


@pytest.fixture(scope="module")
def docker_api():
    # podman's Docker-compatible API, for the v1 client (which speaks only that)
    sock = Path(tempfile.mkdtemp(prefix="podman-api-")) / "podman.sock"
    service = subprocess.Popen(
        [ENGINE, "system", "service", "--time=0", f"unix://{sock}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while not sock.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert sock.exists(), "podman system service did not start"
    yield f"unix://{sock}"
    service.terminate()
    service.wait(30)


@pytest.mark.parametrize("client", ["podman-compose", "docker-compose-v1"])
def test_compose_up_trains_on_the_cpu_and_a_second_up_resumes(image, host, client, request):
    ck, configs = host / "checkpoints", host / "configs"
    assert sh(as_user(["mkdir", "-p", str(ck)])).returncode == 0
    configs.mkdir()
    for epochs in (1, 2):  # the configs folder is mounted: a new file needs no rebuild
        cfg = {**SMALL, "train": {**SMALL["train"], "epochs": epochs}}
        (configs / f"ct-{epochs}.yaml").write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "CONFIGS": str(configs), "USER_ID": str(USER), "GROUP_ID": str(USER)}
    if client == "podman-compose":
        compose = [
            str(ROOT / ".venv" / "bin" / "podman-compose"),
            "-f",
            "docker-compose.yml",
        ]  # no GPUs: the base file alone
    else:
        compose = [str(COMPOSE_V1), "-f", "docker-compose.yml"]
        env["DOCKER_HOST"] = request.getfixturevalue("docker_api")
        # the image as the fixture built it: a build through the Docker API cannot mount the CA bundle
        env["BUILD"] = ""

    def up(config: str) -> str:
        # through `make compose-up` (its mkdir, its variables), with this client
        p = sh(
            [
                "make",
                "-s",
                "compose-up",
                f"COMPOSE={' '.join(compose)}",
                f"IMAGE={image}",
                f"CONFIG=configs/{config}",
                f"DATA={data()}",
                f"CHECKPOINTS={ck}",
                "NPROC=2",
            ],
            timeout=600,
            cwd=ROOT,
            env=env,
        )
        out = p.stdout + p.stderr
        assert p.returncode == 0, out[-4000:]
        return out

    try:
        out = up("ct-1.yaml")
        assert "starting fresh" in out and done(ck) == [32], out[-3000:]
        out = up("ct-2.yaml")
        assert "resuming from /checkpoints/step-32" in out and 64 in done(ck), out[-3000:]
        assert (ck / "step-64").stat().st_uid == USER
    finally:
        sh([*compose, "down"], cwd=ROOT, env=env)


@pytest.mark.parametrize("files", [["docker-compose.yml"], ["docker-compose.yml", "docker-compose.override.yml"]])
def test_docker_compose_v1_accepts_the_files(files):
    # the v1 client (1.29.2) that Debian 12 and Ubuntu 22.04 still ship; `config` validates offline
    args = [a for f in files for a in ("-f", f)]
    p = sh([str(COMPOSE_V1), *args, "config"], cwd=ROOT)
    assert p.returncode == 0, p.stderr
    doc = yaml.safe_load(p.stdout)
    gpus = doc["services"]["train"].get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices")
    assert bool(gpus) == (len(files) == 2)


@pytest.fixture
def registry(tmp_path):
    """A real registry (Debian's docker-registry, the distribution project's server) on localhost."""
    port = free_port()
    config = tmp_path / "registry.yml"
    config.write_text(
        f"version: 0.1\nstorage:\n  filesystem:\n    rootdirectory: {tmp_path / 'store'}\nhttp:\n  addr: "
        f"127.0.0.1:{port}\n"
    )
    server = subprocess.Popen(
        ["docker-registry", "serve", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and sh(["curl", "-sf", f"http://127.0.0.1:{port}/v2/"]).returncode != 0:
        time.sleep(0.2)
    yield f"localhost:{port}"
    server.terminate()
    server.wait(30)


def test_make_push_publishes_the_image_and_prints_the_registrys_digest(registry):
    # a small local image stands in for the trainer's (5.9 GB): the target's tagging, pushing and
    # digest are what is tested
    small = "localhost/debian-minbase:bookworm"
    p = sh(
        [
            "make",
            "-s",
            "push",
            f"ENGINE={ENGINE}",
            f"IMAGE={small}",
            f"REGISTRY={registry}/team",
            "VERSION=t1",
            "PUSH_FLAGS=--tls-verify=false",
        ],
        cwd=ROOT,
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    digest = re.search(
        rf"^by digest: ({re.escape(registry)}/team/cluster-trainer@(sha256:[0-9a-f]{{64}}))$", p.stdout, re.M
    )
    assert digest and f"pushed {registry}/team/cluster-trainer:t1" in p.stdout, p.stdout
    accept = "application/vnd.oci.image.manifest.v1+json, application/vnd.docker.distribution.manifest.v2+json"
    head = sh(
        [
            "curl",
            "-sfI",
            "-H",
            f"Accept: {accept}",
            f"http://{registry.replace('localhost', '127.0.0.1')}/v2/team/cluster-trainer/manifests/t1",
        ]
    )
    # the digest the registry serves
    assert f"docker-content-digest: {digest.group(2)}" in head.stdout.lower(), head.stdout
    render = sh(
        [sys.executable, str(ROOT / "k8s" / "render.py"), "--image", digest.group(1), "--nodes", "2", "--gpus", "1"],
        input=yaml.safe_dump_all(yaml.safe_load_all(sh(["kubectl", "kustomize", "k8s/multi-node"], cwd=ROOT).stdout)),
    )
    assert render.returncode == 0 and digest.group(1) in render.stdout, render.stderr


def test_make_push_without_a_registry_says_so_in_one_line():
    p = sh(["make", "-s", "push", f"ENGINE={ENGINE}"], cwd=ROOT)
    assert (
        p.returncode != 0 and p.stderr.startswith("error: make push needs REGISTRY=") and p.stderr.count("error") == 1
    ), p.stderr


def test_the_image_carries_bytecode_and_runs_as_a_pod_does(image, host):
    """The pods' settings: the image's own uid (10001), a read-only root file system with /tmp and
    HOME writable, every capability dropped, no privilege escalation; torch's bytecode compiled in
    the image (a read-only site-packages would otherwise compile it again at every start)."""
    ck = host / "checkpoints"
    ck.mkdir()
    os.chown(ck, 10001, 10001)
    pod = (
        "--read-only",
        "--tmpfs",
        "/tmp",
        "--tmpfs",
        "/home/trainer:mode=1777",
        "--cap-drop=ALL",
        "--security-opt=no-new-privileges",
    )
    cached = sh(
        [
            ENGINE,
            "run",
            "--rm",
            *pod,
            "--entrypoint",
            "python",
            image,
            "-c",
            "import importlib.util, os, torch, etcd; "
            "print(os.path.exists(importlib.util.cache_from_source(torch.__file__)), os.getuid())",
        ]
    )
    # python-etcd too: k8s/elastic-etcd's rendezvous
    assert cached.stdout.split() == ["True", "10001"], cached.stdout + cached.stderr
    cmd = docker_run(image, ck, "train.epochs=1", user="10001:10001", extra=pod)
    p = sh(cmd, timeout=300)
    assert p.returncode == 0 and done(ck) == [32], (p.stdout + p.stderr)[-3000:]
