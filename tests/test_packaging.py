"""The image's install step, done for real: the Dockerfile's `pip install` in a fresh venv, from
the files it copies, then every module the compose services run imported there, and the
wheel's metadata (license, project URLs), and the wheel a checkout builds: no test or
benchmark tooling in it, no demo and no launcher."""

from __future__ import annotations

import fnmatch
import json
import os
import shlex
import shutil
import subprocess
import sys
import tomllib
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from email.parser import Parser
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

from tests.test_compose import all_commands, option

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO_ROOT / "Dockerfile"
INSTALL_TIMEOUT = 900  # a cold pip cache downloads everything once


# -- reading the Dockerfile ----------------------------------------------------------------


@dataclass(frozen=True)
class Image:
    """What the install step needs from the Dockerfile."""

    workdir: PurePosixPath
    copies: list[tuple[list[str], str]]  # (sources, destination) as written
    pip_install: list[str]  # the arguments after `pip install`
    env: dict[str, str]  # the ENV instructions' variables


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in text.splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        whole = pending + stripped
        pending = ""
        name, _, args = whole.partition(" ")
        out.append((name.upper(), args.strip()))
    return out


def read_image(text: str) -> Image:
    workdir = PurePosixPath("/")
    copies: list[tuple[list[str], str]] = []
    installs: list[list[str]] = []
    env: dict[str, str] = {}
    for name, args in instructions(text):
        if name == "ENV":
            env.update(w.split("=", 1) for w in shlex.split(args) if "=" in w)
        elif name == "WORKDIR":
            workdir = workdir / args
        elif name == "COPY":
            words = [w for w in shlex.split(args) if not w.startswith("--")]
            copies.append((words[:-1], words[-1]))
        elif name == "RUN":
            for step in args.split("&&"):
                words = shlex.split(step)
                if words[:2] == ["pip", "install"]:
                    installs.append(words[2:])
                elif words[:4] == ["python", "-m", "pip", "install"]:
                    installs.append(words[4:])
    assert len(installs) == 1, f"expected one pip install step in the Dockerfile: {installs}"
    return Image(workdir=workdir, copies=copies, pip_install=installs[0], env=env)


def test_the_dockerfile_reader_joins_continuations_and_finds_the_install() -> None:
    image = read_image(
        "FROM python:3.11-slim\nWORKDIR /app\nCOPY a b ./\nCOPY src ./src\n"
        "# a comment\nRUN pip install \".[x]\" 'y>=1' \\\n    && useradd z\n"
        "COPY ex /opt/ex/ex\nENV A=1 \\\n    PYTHONPATH=/opt/ex\n"
    )
    assert image.workdir == PurePosixPath("/app")
    assert image.copies == [(["a", "b"], "./"), (["src"], "./src"), (["ex"], "/opt/ex/ex")]
    assert image.pip_install == [".[x]", "y>=1"]
    assert image.env == {"A": "1", "PYTHONPATH": "/opt/ex"}


# -- building the context and the venv -----------------------------------------------------


def dockerignore() -> list[str]:
    path = REPO_ROOT / ".dockerignore"
    lines = path.read_text().splitlines() if path.exists() else []
    return [ln.strip().removeprefix("**/") for ln in lines if ln.strip() and ln[0] != "#"]


def copy_context(image: Image, dest_root: Path) -> Path:
    """The files the Dockerfile COPYs, laid out under `dest_root` as in the image: relative
    destinations under its WORKDIR, absolute ones under `dest_root`."""
    ignored = dockerignore()

    def ignore(_dir: str, names: list[str]) -> set[str]:
        return {n for n in names if any(fnmatch.fnmatch(n, p) for p in ignored)}

    workdir = dest_root / image.workdir.relative_to("/")
    workdir.mkdir(parents=True, exist_ok=True)
    for sources, dest in image.copies:
        target = dest_root / dest.lstrip("/") if dest.startswith("/") else workdir / dest
        into_dir = dest.endswith("/") or len(sources) > 1
        for source in sources:
            src = REPO_ROOT / source
            assert src.exists(), f"the Dockerfile copies {source}, which does not exist"
            if src.is_dir():  # as Docker does: the directory's contents, not the directory
                shutil.copytree(src, target, symlinks=True, ignore=ignore, dirs_exist_ok=True)
            else:
                (target if into_dir else target.parent).mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, target / src.name if into_dir else target)
    return workdir


def clean_env() -> dict[str, str]:
    """The environment without this checkout: no venv, no PYTHONPATH, pip's cache on."""
    drop = {"VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "PIP_NO_CACHE_DIR", "PIP_REQUIRE_VIRTUALENV"}
    kept = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("JOBFENCE_")}
    # No byte-compiling of every installed module: half of an install's CPU on two cores,
    # and nothing the tests judge (an import compiles what it needs).
    return {**kept, "PIP_NO_COMPILE": "1"}


@dataclass(frozen=True)
class Installed:
    python: Path
    scratch: Path  # an empty directory to run in, so nothing imports from a source tree
    env: dict[str, str]  # with the image's PYTHONPATH (the demo shop beside the install)

    @property
    def bare_env(self) -> dict[str, str]:
        """A bare wheel install's: no PYTHONPATH, so no demo and no repository."""
        return {k: v for k, v in self.env.items() if k != "PYTHONPATH"}

    def run(self, code: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.python), "-c", code],
            cwd=self.scratch, env=self.env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    root = tmp_path_factory.mktemp("image")
    image = read_image(DOCKERFILE.read_text())
    workdir = copy_context(image, root / "fs")
    venv = root / "venv"
    env = clean_env()
    subprocess.run(
        [sys.executable, "-m", "venv", str(venv)], check=True, env=env, timeout=300
    )
    python = venv / "bin" / "python"
    done = subprocess.run(
        [str(python), "-m", "pip", "install", "--disable-pip-version-check", *image.pip_install],
        cwd=workdir, env=env, capture_output=True, text=True, timeout=INSTALL_TIMEOUT,
    )  # fmt: skip
    assert done.returncode == 0, f"the Dockerfile's pip install failed:\n{done.stderr[-3000:]}"
    scratch = root / "run"
    scratch.mkdir()
    fs = root / "fs"  # the image's PYTHONPATH, mapped into the copied files
    paths = [str(fs / p.lstrip("/")) for p in image.env.get("PYTHONPATH", "").split(":") if p]
    run_env = {**env, "PYTHONPATH": os.pathsep.join(paths)} if paths else env
    yield Installed(python=python, scratch=scratch, env=run_env)


# -- what the compose services run ---------------------------------------------------------


def compose_services() -> dict[str, dict[str, Any]]:
    data = yaml.safe_load((REPO_ROOT / "docker-compose.yml").read_text())
    return data["services"]  # type: ignore[no-any-return]


def test_jobfence_comes_from_the_install_not_the_checkout(installed: Installed) -> None:
    done = installed.run("import jobfence, os; print(os.path.realpath(jobfence.__file__))")
    assert done.returncode == 0, done.stderr
    assert "site-packages" in done.stdout and str(REPO_ROOT) not in done.stdout


def test_every_module_the_compose_commands_name_imports(installed: Installed) -> None:
    argvs = all_commands(compose_services())
    apps = sorted({a for argv in argvs if (a := option(argv, "-A", "--app"))})
    modules = sorted({m for argv in argvs if argv[0].startswith("python")
                      and (m := option(argv, "-m"))})  # fmt: skip
    assert apps, "no `celery -A <module>` in docker-compose.yml"
    checks = [f"import {m}" for m in modules]
    checks += [f"import {a}; from celery import Celery; assert isinstance({a}.app, Celery)"
               for a in apps]  # fmt: skip
    if any("flower" in argv for argv in argvs):  # `celery -A app flower`: flower's command
        checks.append("import flower.command")
    failed = {}
    for code in checks:
        done = installed.run(code)
        if done.returncode != 0:
            failed[code] = done.stderr.strip().splitlines()[-1:]
    assert failed == {}, failed


def test_the_servers_the_compose_stack_uses_have_their_clients(installed: Installed) -> None:
    # A broker or database URL is only loaded when a worker connects: load each client
    # here (kombu's transport, SQLAlchemy's driver) without connecting.
    env = {}
    for service in compose_services().values():
        env.update({k: str(v) for k, v in (service.get("environment") or {}).items()})
    urls = {k: v for k, v in env.items() if k.endswith(("_URL", "_BACKEND"))}
    assert {"JOBFENCE_BROKER_URL", "JOBFENCE_DATABASE_URL"} <= set(urls), urls
    code = (
        "import json, sys\n"
        "import sqlalchemy as sa\n"
        "from celery.app.backends import by_url\n"
        "from kombu.transport import resolve_transport\n"
        "from kombu.utils.imports import symbol_by_name\n"
        "urls = json.loads(sys.argv[1])\n"
        "sa.create_engine(urls['JOBFENCE_DATABASE_URL']).dialect.loaded_dbapi\n"
        "broker = urls['JOBFENCE_BROKER_URL']\n"
        "symbol_by_name(resolve_transport(broker.split(':', 1)[0]))\n"
        "by_url(urls.get('JOBFENCE_RESULT_BACKEND') or 'disabled://')\n"
    )
    done = subprocess.run(
        [str(installed.python), "-c", code, json.dumps(urls)],
        cwd=installed.scratch, env=installed.env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr.strip().splitlines()[-3:]


def test_the_cli_runs_from_the_install(installed: Installed) -> None:
    done = subprocess.run(
        [str(installed.python), "-m", "jobfence", "migrate", "--sql",
         "--database", "postgresql+psycopg://app@db/app"],
        cwd=installed.scratch, env=installed.env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "CREATE TABLE IF NOT EXISTS jobfence_fences" in done.stdout


def test_bench_from_the_install_says_the_devstack_is_absent(installed: Installed) -> None:
    done = subprocess.run(
        [str(installed.python), "-m", "jobfence", "bench", "locks"],
        cwd=installed.scratch, env=installed.env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "devstack" in done.stderr and "not in the wheel" in done.stderr, done.stderr


@pytest.mark.parametrize("command", ["demo", "fleet"])
def test_the_demo_and_the_fleet_from_a_bare_install_name_the_checkout(
    installed: Installed, command: str
) -> None:
    """Issue 32, item 6: the demo and its fleet live in demo/ of the repository. From a wheel
    alone, in one line: where they are and what to run instead, no traceback."""
    for env in (installed.bare_env, installed.env):  # the image has the shop, not the demo
        done = subprocess.run(
            [str(installed.python), "-m", "jobfence", command, "--help"],
            cwd=installed.scratch, env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 2, done.stdout + done.stderr
        assert "Traceback" not in done.stderr, done.stderr
        assert "not in the wheel" in done.stderr and "checkout" in done.stderr, done.stderr
        assert f"python -m jobfence {command}" in done.stderr, done.stderr


# -- the wheel's metadata ------------------------------------------------------------------


def test_the_wheel_metadata_carries_the_license_and_the_project_urls(
    installed: Installed,
) -> None:
    done = installed.run(
        "import importlib.metadata as m, json; d = m.distribution('jobfence'); "
        "print(json.dumps({'meta': d.read_text('METADATA'), "
        "'files': [str(f) for f in d.files or []]}))"
    )
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    meta = Parser().parsestr(found["meta"])
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]

    urls = dict(u.split(", ", 1) for u in meta.get_all("Project-URL") or [])
    assert urls == project["urls"]
    assert set(urls) >= {"Homepage", "Source", "Issues", "Changelog"}
    assert meta["License-Expression"] == "MIT"
    assert "LICENSE" in (meta.get_all("License-File") or [])
    assert any(f.endswith(".dist-info/licenses/LICENSE") for f in found["files"])
    extras = set(meta.get_all("Provides-Extra") or [])
    assert {"postgres", "mysql"} <= extras


def test_the_license_and_changelog_are_in_the_repository() -> None:
    license_text = (REPO_ROOT / "LICENSE").read_text()
    assert license_text.startswith("MIT License")
    assert "the jobfence developers" in license_text
    changelog = (REPO_ROOT / "CHANGELOG.md").read_text()
    version = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert "## [Unreleased]" in changelog
    assert f"## [{version}]" in changelog


# -- the wheel holds what users run, not the devstack --------------------------------------

#: Test and benchmark tooling (devstack/, tests/): server launchers, the peers' benches,
#: the fault report.
TOOLING = (
    "devstack/*", "*/devstack/*", "tests/*", "*/tests/*", "*/bench/*", "*/local_*.py",
    "*/redis_masters.py", "*/faults_report.py", "*/servers.py", "*conftest.py", "*/test_*.py",
)  # fmt: skip

#: The demo and its launchers (issue 32, item 6): demo/ (the shop, the storm, the fleet, its
#: embedded stack and journal, the shop's app) and devstack's process and redis-server
#: launchers, by the names they have and had (jobfence/worker/*.py, jobfence/tasks/shop/).
DEMO = (
    "demo/*", "*/demo/*", "*/shop/*", "*/demo.py", "*/storm.py", "*/fleet.py", "*/embedded.py",
    "*/journal.py", "*/celery_app.py", "*/procs.py", "*/redis_server.py",
)  # fmt: skip

#: Product modules the wheel keeps: the CLI, the composition root, setup, the admin commands
#: (and the pid checks they moved into), the lock API.
PRODUCT = (
    "jobfence/worker/cli.py", "jobfence/worker/app.py", "jobfence/worker/setup.py",
    "jobfence/worker/admin.py", "jobfence/locks/procinfo.py", "jobfence/locks/api.py",
    "jobfence/locks/backends/redis/__init__.py",
)  # fmt: skip


def _matching(names: list[str], patterns: tuple[str, ...]) -> list[str]:
    return sorted(f for f in names if any(fnmatch.fnmatch(f, p) for p in patterns))


def _tooling(names: list[str]) -> list[str]:
    return _matching(names, TOOLING)


def test_the_tooling_patterns_catch_every_devstack_and_test_module_wherever_it_lands() -> None:
    """The control of the wheel check: were devstack/ or tests/ packaged, at the top or mapped
    under jobfence/ as the design's folders are, every file of theirs would be caught."""
    tracked = subprocess.run(["git", "ls-files", "devstack", "tests"], cwd=REPO_ROOT,
                             capture_output=True, text=True, check=True).stdout.split()  # fmt: skip
    modules = [n for n in tracked if n.endswith(".py")]
    assert len(modules) > 50 and any(n.startswith("devstack/") for n in modules)
    for where in ("", "jobfence/"):
        packaged = [where + n for n in modules]
        assert _tooling(packaged) == sorted(packaged)
    assert _tooling(list(PRODUCT)) == []


def test_the_demo_patterns_catch_every_demo_and_launcher_module_and_no_product_one() -> None:
    """The control of the wheel's demo check: every module of demo/ and the launchers, at
    the top or mapped under jobfence/, and at the places they had in the wheel, is caught."""
    tracked = subprocess.run(["git", "ls-files", "demo", "devstack/procs.py",
                              "devstack/redis_server.py"], cwd=REPO_ROOT,
                             capture_output=True, text=True, check=True).stdout.split()  # fmt: skip
    modules = [n for n in tracked if n.endswith(".py")]
    assert len(modules) >= 12 and "devstack/procs.py" in modules, modules
    for where in ("", "jobfence/"):
        packaged = [where + n for n in modules]
        assert _matching(packaged, DEMO) == sorted(packaged)
    were = [f"jobfence/worker/{m}.py" for m in ("demo", "fleet", "procs", "redis_server",
                                                "embedded", "journal", "celery_app")]
    were += [f"jobfence/tasks/shop/{m}.py" for m in ("payments", "stock", "ledger", "faults")]
    assert _matching(were, DEMO) == sorted(were)
    assert _matching(list(PRODUCT), DEMO) == []


def copy_checkout(root: Path) -> Path:
    """This checkout's files (tracked and untracked, not ignored, no venv) copied to `root`,
    as a fresh clone with the work in progress would have them."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=REPO_ROOT, capture_output=True, check=True, timeout=60,
    ).stdout.decode().split("\0")  # fmt: skip
    for name in filter(None, listed):  # a checkout's .venv may be an untracked symlink
        if name.split("/")[0].startswith(".venv"):
            continue
        src = REPO_ROOT / name
        if src.is_symlink() or src.is_file():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, root / name, follow_symlinks=False)
    return root


@pytest.fixture(scope="module")
def checkout_wheel(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The file list of the wheel `pip wheel .` builds from this checkout's files."""
    root = copy_checkout(tmp_path_factory.mktemp("checkout"))
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--disable-pip-version-check", "--no-deps",
         "-w", str(root / "dist"), str(root)],
        env=clean_env(), capture_output=True, text=True, timeout=INSTALL_TIMEOUT,
    )  # fmt: skip
    assert done.returncode == 0, f"pip wheel failed:\n{done.stderr[-3000:]}"
    (wheel,) = (root / "dist").glob("jobfence-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        return zf.namelist()


def test_the_wheel_holds_no_test_or_benchmark_tooling(checkout_wheel: list[str]) -> None:
    tooling = _tooling(checkout_wheel)
    assert tooling == [], f"tooling in the wheel (it belongs in devstack/): {tooling}"
    for module in PRODUCT:  # what users import stays
        assert module in checkout_wheel, module


def test_the_wheel_holds_no_demo_and_no_launcher(checkout_wheel: list[str]) -> None:
    """Issue 32, item 6: the wheel shipped 2,668 lines of demo and launchers (the demo, its
    fleet, embedded stack, journal and app, the shop's tasks, the process and redis-server
    launchers) that only the demo, devstack/ and tests used; they live in demo/ and
    devstack/ now, and the wheel holds what users import."""
    demo = _matching(checkout_wheel, DEMO)
    assert demo == [], f"demo or launcher modules in the wheel (they belong in demo/): {demo}"
    assert not [n for n in checkout_wheel if n.split("/")[0] in ("demo", "devstack")]


# -- the README's install section, run as written ----------------------------------------------


def readme_install_lines(text: str) -> list[list[str]]:
    """The commands of the first bash block under the README's "## Install", as words."""
    section = text.split("\n## Install\n", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    return [words for line in block.splitlines() if (words := shlex.split(line, comments=True))]


def test_the_readme_install_section_works_as_written(tmp_path: Path) -> None:
    """Issue 31, item 5: `pip install jobfence` failed wherever no release is on the index.
    Each line runs in a copy of this checkout with a fresh venv's pip; a `pip wheel` line
    starts the second route in a venv of its own, so the wheel's install is not a no-op."""
    lines = readme_install_lines((REPO_ROOT / "README.md").read_text())
    assert lines and all(words[0] == "pip" for words in lines), lines
    assert not any(w.split("[")[0] == "jobfence" for words in lines for w in words[1:]), (
        "the README installs jobfence from the index, which has no release"
    )
    src = copy_checkout(tmp_path / "src")
    env = clean_env()
    venvs: list[Path] = []
    for words in lines:
        if not venvs or words[1] == "wheel":
            venv = tmp_path / f"venv{len(venvs)}"
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, env=env,
                           timeout=300)  # fmt: skip
            venvs.append(venv)
        pip = [str(venvs[-1] / "bin" / "python"), "-m", "pip", "--disable-pip-version-check"]
        done = subprocess.run(
            [*pip, *words[1:]], cwd=src, env=env, capture_output=True, text=True,
            timeout=INSTALL_TIMEOUT,
        )  # fmt: skip
        assert done.returncode == 0, f"{shlex.join(words)} failed:\n{done.stderr[-3000:]}"
    assert len(venvs) == 2, "the README shows a checkout install and a wheel install"
    scratch = tmp_path / "run"
    scratch.mkdir()
    for venv in venvs:  # jobfence from the venv, not the copy, with the extra's driver
        code = "import jobfence, psycopg; print(jobfence.__file__)"
        done = subprocess.run([str(venv / "bin" / "python"), "-c", code], cwd=scratch, env=env,
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert str(venv) in done.stdout, done.stdout
