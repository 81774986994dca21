"""The app for `celery -A worker.celery_app worker|beat`: built from JOBFENCE_* when imported."""

import sys

from jobfence.config import UnsafeSettings
from jobfence.config.errors import EX_CONFIG
from jobfence.worker.app import create_app

try:
    app = create_app()
except UnsafeSettings as exc:
    print(f"jobfence: refusing to start: unsafe settings\n  - {exc}", file=sys.stderr)
    raise SystemExit(EX_CONFIG) from None
