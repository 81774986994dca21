"""A network namespace joined to the host by a veth pair, with nftables rules to cut and heal it.

    with NetNamespace.create() as ns:
        server = RedisServer(bind=(ns.host_address, "127.0.0.1"))   # reachable from inside
        proc = group.spawn([*ns.exec_prefix, sys.executable, "worker.py", ...])
        ns.cut()      # drop every packet between the namespace and the host
        ns.heal()

Everything is named after one random id (namespace ``jf-<id>``, links ``jfh<id>`` and
``jfn<id>``, nftables table ``inet jobfence_<id>``) on a private /30 not in use on this
host, and `close()` removes only those. Needs root and the ``ip`` (iproute2) and ``nft``
(nftables) commands; `unavailable()` says why not, for a test to skip with.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import random
import secrets
import shutil
import subprocess
import weakref
from collections.abc import Iterator, Sequence
from types import TracebackType
from typing import Self

COMMAND_TIMEOUT = 30.0


class NetnsError(RuntimeError):
    """An ``ip`` or ``nft`` command failed."""


def _run(args: Sequence[str], *, stdin: str | None = None, check: bool = True) -> str:
    try:
        done = subprocess.run(
            list(args),
            input=stdin,
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetnsError(f"{' '.join(args)}: {exc}") from exc
    if check and done.returncode != 0:
        raise NetnsError(f"{' '.join(args)} exited {done.returncode}: {done.stderr.strip()}")
    return done.stdout


def unavailable() -> str | None:
    """None if namespaces can be made here, else the reason (for pytest.skip)."""
    if os.geteuid() != 0:
        return "network namespaces and nftables need root (CI runs as root); run as root"
    for tool, package in (("ip", "iproute2"), ("nft", "nftables")):
        if shutil.which(tool) is None:
            return f"`{tool}` not found: install {package} (./.ci/setup does)"
    return None


def _used_networks() -> list[ipaddress.IPv4Network]:
    nets = []
    for line in _run(["ip", "-4", "-o", "addr", "show"]).splitlines():
        fields = line.split()
        if "inet" in fields:
            nets.append(ipaddress.IPv4Interface(fields[fields.index("inet") + 1]).network)
    for line in _run(["ip", "-4", "route", "show", "table", "all"]).splitlines():
        dest = line.split()[0] if line.split() else ""
        with contextlib.suppress(ValueError):
            if dest and dest != "default" and not dest[0].isalpha():
                nets.append(ipaddress.IPv4Network(dest, strict=False))
    return nets


def _free_subnet() -> ipaddress.IPv4Network:
    used = _used_networks()
    rng = random.SystemRandom()
    for _ in range(200):
        net = ipaddress.IPv4Network(
            (f"10.{rng.randrange(200, 250)}.{rng.randrange(256)}.{rng.randrange(64) * 4}", 30)
        )
        if not any(net.overlaps(u) for u in used if u.prefixlen > 0):
            return net
    raise NetnsError("no free /30 found in 10.200.0.0/13")


def _cleanup(name: str, host_link: str, table: str) -> None:
    """Remove what one namespace made; whatever is already gone is fine."""
    _run(["nft", "delete", "table", "inet", table], check=False)
    _run(["ip", "link", "del", host_link], check=False)
    _run(["ip", "netns", "del", name], check=False)


class NetNamespace:
    """A namespace with one veth link to the host; build it with `create()`."""

    def __init__(self, ident: str, subnet: ipaddress.IPv4Network) -> None:
        self.id = ident
        self.name = f"jf-{ident}"
        self.host_link = f"jfh{ident}"
        self.ns_link = f"jfn{ident}"
        self.table = f"jobfence_{ident}"
        hosts = list(subnet.hosts())
        self.subnet = subnet
        self.host_address = str(hosts[0])  # the host's end: bind servers here
        self.ns_address = str(hosts[1])  # the namespace's end
        self._cut = False
        self._closed = False
        self._finalizer = weakref.finalize(self, _cleanup, self.name, self.host_link, self.table)

    @classmethod
    def create(cls) -> NetNamespace:
        """Make the namespace, the veth pair and the addresses; undone on failure."""
        reason = unavailable()
        if reason is not None:
            raise NetnsError(reason)
        ns = cls(secrets.token_hex(4), _free_subnet())
        try:
            ns._setup()
        except BaseException:
            ns.close()
            raise
        return ns

    def _setup(self) -> None:
        prefix = self.subnet.prefixlen
        _run(["ip", "netns", "add", self.name])
        _run(["ip", "link", "add", self.host_link, "type", "veth",
              "peer", "name", self.ns_link, "netns", self.name])  # fmt: skip
        _run(["ip", "addr", "add", f"{self.host_address}/{prefix}", "dev", self.host_link])
        _run(["ip", "link", "set", self.host_link, "up"])
        inside = ["ip", "-n", self.name]
        _run([*inside, "addr", "add", f"{self.ns_address}/{prefix}", "dev", self.ns_link])
        _run([*inside, "link", "set", self.ns_link, "up"])
        _run([*inside, "link", "set", "lo", "up"])

    @property
    def exec_prefix(self) -> list[str]:
        """Prepend to a command to run it inside the namespace (``ip netns exec`` execs it,
        so the process's pid is the command's own)."""
        return ["ip", "netns", "exec", self.name]

    # -- faults ----------------------------------------------------------------------
    @property
    def is_cut(self) -> bool:
        return self._cut

    def cut(self) -> None:
        """Drop every packet between the namespace and the host, both ways (no RST, no
        ICMP: a silent partition; TCP retransmits once healed)."""
        if self._cut:
            return
        link = self.host_link
        _run(["nft", "-f", "-"], stdin=(
            f"table inet {self.table} {{\n"
            f"  chain input {{ type filter hook input priority -300; policy accept;"
            f" iifname \"{link}\" drop; }}\n"
            f"  chain output {{ type filter hook output priority -300; policy accept;"
            f" oifname \"{link}\" drop; }}\n"
            f"}}\n"
        ))  # fmt: skip
        self._cut = True

    def heal(self) -> None:
        """Remove the drop rules (the table is ours alone)."""
        if not self._cut:
            return
        _run(["nft", "delete", "table", "inet", self.table])
        self._cut = False

    @contextlib.contextmanager
    def partitioned(self) -> Iterator[None]:
        """Cut inside the block, healed on exit (even on error)."""
        self.cut()
        try:
            yield
        finally:
            self.heal()

    # -- teardown ----------------------------------------------------------------------
    def close(self) -> None:
        """Remove the rules, the links and the namespace; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._cut = False
        self._finalizer()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("cut" if self._cut else "up")
        return f"<NetNamespace {self.name} {self.host_address}<->{self.ns_address} {state}>"
