"""How the suite is split among pytest-xdist workers (`make test`: ``-n 3 --dist loadscope``)."""

from __future__ import annotations

from collections import OrderedDict

from xdist.scheduler import LoadScopeScheduling
from xdist.workermanage import WorkerController

from tests.contract.conftest import BACKENDS

# Files whose tests run on one worker, one after the other, because they share something
# more than a file does. Empty today: every server, database, namespace and broker a test
# uses is private to it or to its worker (named by uuid or pid, on a port the kernel picks).
SHARED_WORKER: dict[str, str] = {}
# The contract's races (50 forked processes, or threads that must keep pace with a rate) on
# every backend, one after the other: a race is a burst of load that starves a race beside it.
RACES = "contract-races"
# Handed out first: the files of real fleets and faults and the contract races, a minute or
# more each, so that none of them starts last and runs alone while the other workers idle.
LONG_FIRST = ("tests/faults/", "tests/integration/", "tests/workflows/", RACES)


def scope_of(nodeid: str) -> str:
    """The unit of work a test belongs to: a contract race, with the other races; a contract
    test's backend, so that each worker starts only its backends' servers (a Sentinel
    topology, Redlock masters, a Cluster); else its file, so that a module's private broker
    and worker fleet start once, as in a serial run."""
    path, _, name = nodeid.partition("::")
    if path in SHARED_WORKER:
        return SHARED_WORKER[path]
    if path.startswith("tests/contract/") and "racing" in name:
        return RACES
    if path.startswith("tests/contract/") and name.endswith("]"):
        params = name[name.index("[") + 1 : -1].split("-")
        backend = next((p for p in params if p in BACKENDS), None)
        if backend is not None:
            return f"contract-{backend}"
    return path


class SuiteScheduling(LoadScopeScheduling):
    """``--dist loadscope`` with this suite's scopes (`scope_of`) instead of modules."""

    _ordered = False

    def _split_scope(self, nodeid: str) -> str:
        return scope_of(nodeid)

    def _assign_work_unit(self, node: WorkerController) -> None:
        if not self._ordered:  # the queue is whole by the first hand-out
            units = sorted(
                self.workqueue.items(), key=lambda unit: not unit[0].startswith(LONG_FIRST)
            )
            self.workqueue = OrderedDict(units)
            self._ordered = True
        super()._assign_work_unit(node)
