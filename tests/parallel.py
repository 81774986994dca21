"""How the suite is split among pytest-xdist workers (`make test`: ``-n 4 --dist loadscope``)."""

from __future__ import annotations

from collections import OrderedDict

from xdist.scheduler import LoadScopeScheduling
from xdist.workermanage import WorkerController

# Folders whose tests run on one worker, one after the other. The contract suite's timings
# are tight (a 1 s leader TTL, a 40/s rate kept pace with, 50 forked racers): on 2 cores two
# of its backends side by side starve each other (4 workers: 5 failures; serially: none).
ONE_WORKER = {"tests/contract/": "tests/contract"}
# Handed out first: the contract suite and the files of real fleets and faults, a minute or
# more each, so that none of them starts last and runs alone while the other workers idle.
LONG_FIRST = ("tests/contract", "tests/faults/", "tests/integration/", "tests/workflows/")


def scope_of(nodeid: str) -> str:
    """The unit of work a test belongs to: its folder where ONE_WORKER names it, else its
    file, so that a module's private broker and worker fleet start once, as in a serial
    run. Every server, database, namespace and broker a test uses is private to it or to
    its worker (named by uuid or pid, on a port the kernel picks): nothing else is shared."""
    path = nodeid.partition("::")[0]
    return next((unit for folder, unit in ONE_WORKER.items() if path.startswith(folder)), path)


class SuiteScheduling(LoadScopeScheduling):
    """``--dist loadscope`` with this suite's units (`scope_of`) instead of modules."""

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
