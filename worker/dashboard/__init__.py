"""The lock dashboard: pages over a lock backend, served standalone (ASGI) or mounted in Django.

`core.Dashboard` holds the page logic as plain functions of a request; `asgi.build_app` and
`django.urls` are the two thin shells. The data it reads comes from `data` (never a task
argument, owner token or secret: a key is shown as its task name and a hash).
"""

from jobfence.worker.dashboard.core import Dashboard, Request, Response

__all__ = ["Dashboard", "Request", "Response"]
