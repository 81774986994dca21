"""`python -m worker …`: the jobfence command line."""

from worker.cli import main

raise SystemExit(main())
