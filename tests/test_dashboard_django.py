"""The dashboard mounted in a Django project: staff only, a permission, Django's CSRF check
first. Run in a child process: Django is configured there only."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("django")
pytest.importorskip("jinja2", reason="the dashboard extra: pip install 'jobfence[dashboard]'")

SCRIPT = textwrap.dedent(
    """
    import sys, types
    import django
    from django.conf import settings
    settings.configure(
        DEBUG=False, SECRET_KEY="x" * 50, ALLOWED_HOSTS=["testserver"], ROOT_URLCONF="dashurls",
        INSTALLED_APPS=["django.contrib.admin", "django.contrib.auth",
                        "django.contrib.contenttypes", "django.contrib.sessions",
                        "django.contrib.messages"],
        MIDDLEWARE=["django.contrib.sessions.middleware.SessionMiddleware",
                    "django.middleware.csrf.CsrfViewMiddleware",
                    "django.contrib.auth.middleware.AuthenticationMiddleware",
                    "django.contrib.messages.middleware.MessageMiddleware"],
        DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}},
        TEMPLATES=[{"BACKEND": "django.template.backends.django.DjangoTemplates",
                    "APP_DIRS": True, "OPTIONS": {"context_processors": [
                        "django.contrib.auth.context_processors.auth",
                        "django.contrib.messages.context_processors.messages",
                        "django.template.context_processors.request"]}}],
    )
    django.setup()
    from django.contrib import admin
    from django.contrib.auth.models import Permission, User
    from django.core.management import call_command
    from django.test import Client
    from django.urls import include, path
    from jobfence.locks import open_backend
    from jobfence.worker.dashboard import Dashboard
    from jobfence.worker.dashboard.django import dashboard_urls

    backend = open_backend("memory://")
    from jobfence.locks.backend import default_meta
    backend.try_acquire("shop.charge:" + "ab" * 20, 60, meta=default_meta(task_name="shop.charge"))
    urls = types.ModuleType("dashurls")
    urls.urlpatterns = [
        path("admin/jobfence/", include(dashboard_urls(
            lambda: Dashboard(backend, actions=True), root="/admin/jobfence",
            permission="auth.change_user"))),
        path("admin/", admin.site.urls),
    ]
    sys.modules["dashurls"] = urls
    call_command("migrate", verbosity=0)
    User.objects.create_user("plain", password="pw")
    staff = User.objects.create_user("staff", password="pw", is_staff=True)
    boss = User.objects.create_user("boss", password="pw", is_staff=True)
    boss.user_permissions.add(Permission.objects.get(codename="change_user"))

    c = Client()
    r = c.get("/admin/jobfence/")
    print("anonymous", r.status_code, r.headers.get("Location", ""))
    c.login(username="plain", password="pw")
    print("plain", c.get("/admin/jobfence/").status_code)
    c.login(username="staff", password="pw")
    print("staff-no-perm", c.get("/admin/jobfence/").status_code)
    c = Client(enforce_csrf_checks=True)
    c.login(username="boss", password="pw")
    page = c.get("/admin/jobfence/")
    print("boss", page.status_code, "shop.charge:" + "ab" * 20 in page.content.decode())
    print("slots", c.get("/admin/jobfence/slots").status_code)
    print("post-no-django-csrf", c.post("/admin/jobfence/release", {"id": "0" * 24}).status_code)
    # The staff login is the dashboard's login: a release reaches its checks (no token set).
    csrf = c.cookies["csrftoken"].value
    r = c.post("/admin/jobfence/release", {"id": "0" * 24, "fence": "x",
                                           "csrfmiddlewaretoken": csrf})
    print("staff-release", r.status_code, "fence must be" in r.content.decode())
    # The find form posts through Django's CSRF check too (no app given here: it says so).
    print("find-form", "csrfmiddlewaretoken" in c.get("/admin/jobfence/find").content.decode())
    r = c.post("/admin/jobfence/find", {"task": "shop.charge", "csrfmiddlewaretoken": csrf})
    print("find", r.status_code, "app=celery_app" in r.content.decode())
    # Django vets the Host (ALLOWED_HOSTS): a rebinding name is refused before the dashboard.
    print("rebinding", c.get("/admin/jobfence/", HTTP_HOST="evil.example:8000").status_code)
    """
)


def test_the_dashboard_in_django_is_for_staff_with_the_permission_and_csrf_checked() -> None:
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          env=env, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert lines["anonymous"].startswith("302 /admin/login/")
    assert lines["plain"].startswith("302")  # not staff: to the admin login
    assert lines["staff-no-perm"] == "403"
    assert lines["boss"] == "200 True"
    assert lines["slots"] == "200"
    assert lines["post-no-django-csrf"] == "403"  # Django's CSRF check, before the dashboard's
    assert lines["staff-release"] == "400 True"  # past the login check, to the form's
    assert lines["rebinding"] == "400"  # DisallowedHost
    assert lines["find-form"] == "True" and lines["find"] == "400 True"
