"""The dashboard in a Django project: `path("admin/jobfence/", include(dashboard_urls(...)))`,
behind the admin login and a permission; Django's own CSRF check runs before the dashboard's.
Django vets the Host (ALLOWED_HOSTS), and its staff login is the dashboard's login."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.contrib.admin.views.decorators import staff_member_required
from django.contrib.auth.decorators import permission_required
from django.http import HttpRequest, HttpResponse
from django.middleware.csrf import get_token
from django.urls import URLPattern, re_path
from django.utils.html import format_html
from django.views.decorators.csrf import csrf_protect

from jobfence.worker.dashboard.core import Dashboard, Request

VIEW_PERMISSION = "jobfence.view_dashboard"


def to_request(request: HttpRequest, rest: str, root: str) -> Request:
    return Request(
        method=request.method or "GET",
        path="/" + rest,
        query={k: request.GET.get(k, "") for k in request.GET},
        form={k: request.POST.get(k, "") for k in request.POST},
        cookies=dict(request.COOKIES),
        origin=request.headers.get("Origin", ""),
        host=request.get_host(),
        root=root,
        user=str(getattr(request, "user", "anonymous")),
        host_checked=True,  # get_host() raised DisallowedHost for a Host not in ALLOWED_HOSTS
        authenticated=_is_staff(request),
        csrf_input=format_html(
            '<input type="hidden" name="csrfmiddlewaretoken" value="{}">', get_token(request)
        ),
    )


def _is_staff(request: HttpRequest) -> bool:
    user = getattr(request, "user", None)
    return bool(user is not None and user.is_active and user.is_staff)


def dashboard_urls(
    dashboard: Dashboard | Callable[[], Dashboard],
    *,
    root: str,
    permission: str | None = None,
) -> list[URLPattern]:
    """URL patterns serving `dashboard` under `root` (the path they are included at, e.g.
    "/admin/jobfence"), for staff users with `permission` (None: staff is enough).

    Pass a factory to build the Dashboard (and open its backend) on the first request.
    """
    built: list[Dashboard] = []

    def get() -> Dashboard:
        if not built:
            built.append(dashboard() if callable(dashboard) else dashboard)
        return built[0]

    def view(request: HttpRequest, rest: str = "") -> HttpResponse:
        resp = get().handle(to_request(request, rest, root.rstrip("/")))
        out = HttpResponse(resp.body, status=resp.status, content_type=resp.content_type)
        out["Cache-Control"] = "no-store"
        for name, value in resp.headers.items():
            out[name] = value
        if resp.set_cookie:
            name, value = resp.set_cookie
            out.set_cookie(name, value, httponly=True, samesite="Strict", path=root or "/")
        return out

    # The login first (anonymous users go to the admin login), then the permission (403).
    guarded: Any = view
    if permission is not None:
        guarded = permission_required(permission, raise_exception=True)(guarded)
    guarded = staff_member_required(csrf_protect(guarded))
    return [re_path(r"^(?P<rest>[a-z]*)$", guarded, name="jobfence-dashboard")]
