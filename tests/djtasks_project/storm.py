"""Enqueue a duplicate storm of Django tasks; print the result ids as JSON.

Usage: python -m tests.djtasks_project.storm TASK FIRST_INVOICE INVOICES COPIES [SEED]
(several of these run side by side, one SEED each, as web processes would enqueue)
"""

from __future__ import annotations

import json
import os
import random
import sys

import django


def main(argv: list[str]) -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.djtasks_project.settings")
    django.setup()
    from tests.djtasks_project.billing import tasks

    name, first, invoices, copies = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    seed = int(argv[4]) if len(argv) > 4 else 0
    task = getattr(tasks, name)
    jobs = [(first + n, 100 + n) for n in range(invoices) for _ in range(copies)]
    random.Random(first * 1000 + seed).shuffle(jobs)
    print(json.dumps([task.enqueue(invoice, amount).id for invoice, amount in jobs]))


if __name__ == "__main__":
    main(sys.argv[1:])
