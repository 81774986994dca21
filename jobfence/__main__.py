"""`python -m jobfence …`: the jobfence command line (fleet, demo, locks, check, bench)."""

from jobfence.worker.cli import main

raise SystemExit(main())
