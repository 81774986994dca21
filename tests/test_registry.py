"""The backend registry: the one list of lock URL schemes, lazy imports with install hints,
refusals derived from capabilities, and a backend added by one registry line."""

from __future__ import annotations

import asyncio
import importlib
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest

from jobfence import AsyncLocker
from jobfence.config import Settings, UnsafeSettings
from jobfence.locks import (
    AcquireTimeout,
    LockBackend,
    Locker,
    MemoryBackend,
    RateLimitUnsupported,
    SemaphoreUnsupported,
    open_backend,
    registry,
)
from jobfence.locks.backend import Capabilities
from jobfence.locks.registry import BackendEntry

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BACKENDS_PAGE = ROOT / "docs" / "explanation" / "backends.md"
SECRET = "a-real-random-secret-0123456789abcdef"


class ToyBackend(MemoryBackend):
    """A backend added at run time: a memory store that keeps no semaphores or rate limits."""

    name: ClassVar[str] = "toy"
    capabilities: ClassVar[Capabilities] = Capabilities(
        native_fencing=True, durable_fence=False, ha=False, release_notify=True
    )


@pytest.fixture
def toy() -> Iterator[BackendEntry]:
    entry = registry.register(
        BackendEntry("toy", ("toy",), __name__, "ToyBackend", ToyBackend.capabilities)
    )
    try:
        yield entry
    finally:
        registry.unregister("toy")


def _table_schemes(page: Path) -> set[str]:
    """The schemes in the first table of `page` whose header is "| backend | URL schemes |"."""
    header = "| backend | URL schemes |"
    section = header + page.read_text().split(header, 1)[1]
    section = section.split("\n\n", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")][1:]  # no header
    cells = [row.split(" | ")[1] for row in rows]
    return {m for cell in cells for m in re.findall(r"`([a-z+]+)://", cell)}


@pytest.mark.parametrize("page", [BACKENDS_PAGE, README], ids=["docs", "readme"])
def test_every_scheme_in_the_backend_tables_is_registered_and_no_other(page: Path) -> None:
    assert _table_schemes(page) == set(registry.lock_schemes())
    for scheme in registry.lock_schemes():
        assert scheme in registry.entry_for(f"{scheme.upper()}://host").schemes


def test_every_entry_imports_a_lock_backend_class_with_the_entry_name_and_capabilities() -> None:
    for entry in registry.entries():
        cls = entry.load()
        assert issubclass(cls, LockBackend), entry
        assert cls.name == entry.name
        assert cls.capabilities == entry.capabilities, f"{entry.name}: the registry line differs"
        assert callable(getattr(cls, "from_url", None)), f"{cls.__name__} has no from_url"


def test_an_unknown_scheme_is_refused_naming_every_registered_one() -> None:
    with pytest.raises(ValueError, match="no lock backend for scheme 'ftp'") as caught:
        open_backend("ftp://host/x")
    with pytest.raises(UnsafeSettings) as refused:
        Settings(lock_url="ftp://host/x")
    for scheme in registry.lock_schemes():
        assert f"{scheme}://" in str(caught.value) and f"{scheme}://" in str(refused.value)


@pytest.mark.parametrize(
    ("library", "url", "hint"),
    [
        ("psycopg", "postgresql://postgres@127.0.0.1:5432/x", "jobfence[postgres]"),
        ("pymysql", "mariadb://root@127.0.0.1:3306/x", "jobfence[mysql]"),
        ("kazoo", "zookeeper://127.0.0.1:2181", "jobfence[zookeeper]"),
    ],
)
def test_a_missing_extra_raises_its_install_hint(library: str, url: str, hint: str) -> None:
    # The library is hidden by a meta-path finder, as if its extra were not installed.
    code = (
        "import sys\n"
        "class Hide:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name.split('.')[0] == {library!r}:\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Hide())\n"
        "from jobfence.locks import open_backend\n"
        "try:\n"
        f"    open_backend({url!r})\n"
        "except ModuleNotFoundError as exc:\n"
        "    print(exc)\n"
        "    print('name:', exc.name)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    scheme = url.split("://", 1)[0]
    assert f"the {scheme}:// lock backend needs {library}: pip install '{hint}'" in out.stdout
    assert f"name: {library}" in out.stdout


def test_the_django_helpers_without_django_name_their_extra() -> None:
    """Issue 31, item 8: `from jobfence.tasks.django import django_effects` without Django
    was a bare ModuleNotFoundError; it names the extra as the backends' do (still a
    ModuleNotFoundError, so code that catches one keeps working)."""
    code = (
        "import sys\n"
        "class Hide:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'django':\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Hide())\n"
        "try:\n"
        "    from jobfence.tasks.django import django_effects\n"
        "except ModuleNotFoundError as exc:\n"
        "    print(exc)\n"
        "    print('name:', exc.name)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert "needs Django: pip install 'jobfence[django]'" in out.stdout, out.stdout
    assert "name: django" in out.stdout


def test_an_import_error_other_than_the_extra_is_not_disguised_as_one() -> None:
    broken = BackendEntry(
        "broken", ("broken",), "tests.no_such_module", "Backend", ToyBackend.capabilities,
        extra="postgres", requires="psycopg",
    )  # fmt: skip
    registry.register(broken)
    try:
        with pytest.raises(ModuleNotFoundError) as caught:
            open_backend("broken://x")
    finally:
        registry.unregister("broken")
    assert caught.value.name == "tests.no_such_module" and "pip install" not in str(caught.value)


def test_a_backend_registered_by_one_line_is_opened_checked_and_listed(
    toy: BackendEntry,
) -> None:
    backend = open_backend("toy://anywhere:1", prefix="ignored")
    assert type(backend) is ToyBackend
    assert Settings(lock_url="toy://anywhere:1", key_secret=SECRET).lock_url == "toy://anywhere:1"
    # An entry without a URL check of its own gets the one-host checks.
    with pytest.raises(UnsafeSettings, match="port 'x', which is not a number"):
        Settings(lock_url="toy://anywhere:x", key_secret=SECRET)
    with pytest.raises(ValueError, match=r"toy://"):
        open_backend("nope://x")
    with Locker(backend).lock("k", ttl=5) as lease:
        assert lease.fence > 0
    assert registry.backends_with("native_fencing").endswith("or toy://")


#: A backend as a user adds one: this module in a file of its own, and the registry line
#: in the fixture. Nothing else names it (the fixture registers and unregisters it).
SHELF_MODULE = """\
\"\"\"A lock backend of one process's memory, added by one module and one registry line.\"\"\"

from typing import ClassVar

from jobfence.locks import MemoryBackend
from jobfence.locks.backend import Capabilities


class ShelfBackend(MemoryBackend):
    name: ClassVar[str] = "shelf"
    capabilities: ClassVar[Capabilities] = Capabilities(
        native_fencing=True, durable_fence=False, ha=False, release_notify=True
    )
"""


@pytest.fixture
def shelf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[BackendEntry]:
    (tmp_path / "jf_shelf_backend.py").write_text(SHELF_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    caps = Capabilities(native_fencing=True, durable_fence=False, ha=False, release_notify=True)
    # The registry line, as locks/registry.py would have it:
    entry = registry.register(BackendEntry("shelf", ("shelf",), "jf_shelf_backend", "ShelfBackend",
                                           caps))  # fmt: skip
    assert "jf_shelf_backend" not in sys.modules  # imported on first use, not at register
    try:
        yield entry
    finally:
        registry.unregister("shelf")
        sys.modules.pop("jf_shelf_backend", None)


def test_a_backend_in_its_own_module_works_through_both_lockers_by_its_registry_line(
    shelf: BackendEntry,
) -> None:
    locker = Locker.from_url("shelf://")
    backend = locker.backend
    assert type(backend).__module__ == "jf_shelf_backend" and backend.name == "shelf"
    assert shelf.load().capabilities == shelf.capabilities
    # The contract's basics: a grant with a fence, exclusion, release, a higher next fence.
    with locker.lock("k", ttl=5) as first:
        assert first.fence > 0 and backend.inspect("k") is not None
        with pytest.raises(AcquireTimeout):
            locker.acquire("k", ttl=5, blocking=False)
        first.extend()
    assert backend.inspect("k") is None
    with locker.lock("k", ttl=5) as second:
        assert second.fence > first.fence
    locker.close()

    async def contend() -> list[int]:
        alocker = AsyncLocker.from_url("shelf://")
        fences = []
        try:
            async with alocker.lock("k", ttl=5) as lease:
                fences.append(lease.fence)
                with pytest.raises(AcquireTimeout):
                    await alocker.acquire("k", ttl=5, blocking=False)
            async with alocker.lock("k", ttl=5) as lease:
                fences.append(lease.fence)
        finally:
            await alocker.aclose()
        return fences

    fences = asyncio.run(contend())
    assert fences[0] > 0 and fences[1] > fences[0]
    assert importlib.import_module("jf_shelf_backend").ShelfBackend is type(backend)


def test_registering_a_taken_scheme_is_refused(toy: BackendEntry) -> None:
    with pytest.raises(ValueError, match="already registered"):
        registry.register(BackendEntry("toy2", ("redis",), __name__, "ToyBackend",
                                       ToyBackend.capabilities))  # fmt: skip
    assert registry.entry_for("redis://h").name == "redis"


def test_refusals_name_the_backends_whose_capabilities_allow_it(toy: BackendEntry) -> None:
    rate = [e for e in registry.entries() if e.capabilities.rate_limit and e.fleet]
    sem = [e for e in registry.entries() if e.capabilities.semaphore]
    assert {e.name for e in rate} >= {"redis", "postgres", "mysql", "redis-sentinel"}
    locker = Locker(open_backend("toy://"))
    with pytest.raises(RateLimitUnsupported) as no_rate:
        locker.rate_limiter("api", "10/s")
    with pytest.raises(SemaphoreUnsupported) as no_sem:
        locker.acquire_slot("k", limit=2, ttl=5)
    assert f"{rate[0].schemes[0]}://" in str(no_rate.value)
    assert registry.backends_with("rate_limit") in str(no_rate.value)
    assert registry.backends_with("semaphore", fleet=False) in str(no_sem.value)
    for entry in registry.entries():
        named = f"{entry.schemes[0]}://"
        assert (named in str(no_rate.value)) == (entry in rate), entry.name
        assert (named in str(no_sem.value)) == (entry in sem), entry.name


def test_health_reports_a_lock_server_that_does_not_answer() -> None:
    with socket.socket() as probe:  # a port nothing listens on once this closes
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    backend = open_backend(f"redis://:hunter2@127.0.0.1:{port}/0")
    health = backend.health()
    assert not health.ok and health.latency >= 0
    assert "ConnectionError" in health.detail and "hunter2" not in health.detail
    backend.close()
