"""The dashboard's page logic as plain functions of a `Request`: the ASGI and Django shells
only translate their request into one and its `Response` back.

Actions are read-only unless enabled, each behind a confirmation page whose form carries an
action token: an HMAC over the action, the lock id, the fence and holder the page showed, and
the browser's own cookie. A forged or replayed POST, a missing confirmation, a stale view (the
holder changed since the page was drawn) and a holder not provably dead are refused, and
nothing changes.

Before any page: the Host must be one the dashboard answers to (421 otherwise: a DNS-rebinding
page names its own host), a POST's Origin must be one of them too, and with a token (`guard`)
the request must carry it (a bearer header or the login form's cookie). An action needs a login:
the token's, or the shell's own (Django's staff login).

Requests and responses are `web`'s; action tokens and the action log `actions`'; the live
figures `live`'s; what the pages read `data`'s."""

from __future__ import annotations

import json
import logging
import secrets
import time
import urllib.parse
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

import jinja2
import markupsafe

from jobfence.locks import LockBackend, LockError, LockInfo
from jobfence.worker.admin import advance_fence, printable, release_grant
from jobfence.worker.dashboard import live
from jobfence.worker.dashboard.actions import COOKIE as COOKIE
from jobfence.worker.dashboard.actions import TOKEN_TTL as TOKEN_TTL
from jobfence.worker.dashboard.actions import ActionRecord as ActionRecord
from jobfence.worker.dashboard.actions import ActionTokens
from jobfence.worker.dashboard.data import (
    BadInput,
    LockRow,
    LockView,
    beat_rows,
    check_cursor,
    check_glob,
    check_key_id,
    key_label,
)
from jobfence.worker.dashboard.find import job_key
from jobfence.worker.dashboard.guard import (
    LOGIN_COOKIE,
    LOOPBACK_HOSTS,
    TOKEN_ENV,
    HostList,
    Login,
    check_token,
)
from jobfence.worker.dashboard.web import Request as Request
from jobfence.worker.dashboard.web import Response as Response
from jobfence.worker.dashboard.web import plain, redirect, safe_next, secs, when

log = logging.getLogger("jobfence.dashboard")


class Dashboard:
    """The pages over one lock backend. `actions` False (the default) makes it read-only.

    `allowed_hosts`: the Host values it answers (default: the loopback names, any port; a
    shell that vets the Host itself says so per request). `token`: the login (at least 32
    random characters, e.g. from JOBFENCE_DASHBOARD_TOKEN); without one, only a shell's own
    login (Django's) can act. `app`: the Celery app, to find a job by its task and arguments
    (keyed as its workers key them) and to read its beat schedule. `hide_names`: show plain
    locks by their hash, not the name their owner gave them."""

    def __init__(
        self,
        backend: LockBackend,
        *,
        actions: bool = False,
        secret: bytes | None = None,
        hostname: str | None = None,
        app: Any = None,
        metrics_url: str = "",
        refresh: float = 5.0,
        allowed_hosts: Iterable[str] = LOOPBACK_HOSTS,
        token: str | None = None,
        hide_names: bool = False,
    ) -> None:
        self.hosts = HostList(allowed_hosts)
        checked = check_token(token)
        self.login = Login(checked) if checked is not None else None
        self.backend = backend
        self.view = LockView(backend, hostname=hostname, hide_names=hide_names)
        self.actions = actions
        self.secret = secret or secrets.token_bytes(32)
        self.app = app  # a Celery app: its beat schedule fills the beat table
        self.metrics_url = metrics_url
        self.refresh = refresh
        self.tokens = ActionTokens(self.secret)
        self.log: deque[ActionRecord] = deque(maxlen=200)
        loader = jinja2.PackageLoader("jobfence.worker.dashboard", "templates")
        self.env = jinja2.Environment(
            loader=loader, autoescape=True, undefined=jinja2.StrictUndefined
        )
        self.env.filters["when"] = when
        self.env.filters["secs"] = secs

    # ------------------------------------------------------------------- dispatch
    def handle(self, req: Request) -> Response:
        if not req.host_checked and not self.hosts.allows(req.host):
            return plain(421, f"421 Misdirected Request: this dashboard does not answer to the "
                               f"host name {printable(req.host)!r}. If that is the name you "
                               f"browse it by, start it with --allowed-host NAME.")  # fmt: skip
        if req.method.upper() == "POST" and req.origin and not self._origin_ok(req):
            return plain(403, "403 Forbidden: the request came from another site (its Origin "
                               "is not this dashboard); nothing was changed.")  # fmt: skip
        authed = req.authenticated
        if self.login is not None and not authed:
            authed = self.login.bearer_ok(req.authorization) or self.login.cookie_ok(
                req.cookies.get(LOGIN_COOKIE, "")
            )
            if not authed:
                if (req.method.upper(), req.path) == ("POST", "/login"):
                    return self.do_login(req)
                return self.login_page(req, "")
        return self.dispatch(replace(req, authenticated=authed))

    def _origin_ok(self, req: Request) -> bool:
        if req.host_checked:  # the shell's Host: the Origin must name it
            return urllib.parse.urlsplit(req.origin).netloc.lower() == req.host.lower()
        return self.hosts.allows_origin(req.origin)

    def dispatch(self, req: Request) -> Response:
        routes: dict[tuple[str, str], Callable[[Request], Response]] = {
            ("GET", "/"): self.locks_page,
            ("GET", "/lock"): self.lock_page,
            ("GET", "/slots"): self.slots_page,
            ("GET", "/leaders"): self.leaders_page,
            ("GET", "/records"): self.records_page,
            ("GET", "/live"): self.live,
            ("GET", "/confirm"): self.confirm_page,
            ("GET", "/find"): self.find_form,
            ("POST", "/find"): self.find_page,
            ("POST", "/release"): self.release,
            ("GET", "/login"): self.logged_in,
            ("POST", "/login"): self.logged_in,
            ("POST", "/logout"): self.logout,
        }
        page = routes.get((req.method.upper(), req.path or "/"))
        if page is None:
            return self._error(req, 404, "no such page", "start from the locks page")
        try:
            resp = page(req)
        except BadInput as exc:
            resp = self._error(req, 400, "bad request", str(exc))
        except LockError as exc:
            resp = self._error(req, 503, "the lock server did not answer", printable(exc))
        if COOKIE not in req.cookies:
            resp.set_cookie = (COOKIE, secrets.token_hex(16))
        return resp

    def render(self, req: Request, template: str, status: int = 200, **ctx: Any) -> Response:
        html = self.env.get_template(template).render(
            root=req.root, backend=self.backend.name, actions=self.actions, req=req,
            login=self.login is not None, refresh=self.refresh,
            metrics=bool(self.metrics_url),
            csrf_input=markupsafe.Markup(req.csrf_input), **ctx,
        )  # fmt: skip
        return Response(status, html)

    def _error(self, req: Request, status: int, title: str, detail: str) -> Response:
        return self.render(req, "error.html", status, title=title, detail=detail)

    # ------------------------------------------------------------------- login
    def login_page(self, req: Request, why: str) -> Response:
        """401 with the login form (a browser) and a Bearer challenge (a script)."""
        if req.method.upper() == "GET":
            nxt = req.path + ("?" + urllib.parse.urlencode(dict(req.query)) if req.query else "")
        else:  # a failed login: on to where it was going
            nxt = safe_next(req.form.get("next", "/"))
        html = self.env.get_template("login.html").render(
            root=req.root, next=nxt, why=why, csrf_input=markupsafe.Markup(req.csrf_input),
            variable=TOKEN_ENV,
        )  # fmt: skip
        return Response(401, html, headers={"WWW-Authenticate": 'Bearer realm="jobfence"'})

    def do_login(self, req: Request) -> Response:
        assert self.login is not None
        if not self.login.token_matches(req.form.get("token", "")):
            log.warning("dashboard: a failed login from %s", printable(req.user))
            return self.login_page(req, "That is not the token this dashboard was started with.")
        log.info("dashboard: a login from %s", printable(req.user))
        resp = redirect(req, safe_next(req.form.get("next", "/")))
        resp.login_cookie = self.login.mint_cookie()
        return resp

    def logged_in(self, req: Request) -> Response:
        """/login once logged in (by the token, or the shell): on to the page asked for."""
        if self.login is None and not req.authenticated:
            return self._error(req, 404, "no such page", "this dashboard has no login")
        return redirect(req, safe_next(req.form.get("next", req.query.get("next", "/"))))

    def logout(self, req: Request) -> Response:
        resp = redirect(req, "/")
        resp.login_cookie = ""
        return resp

    # ------------------------------------------------------------------- pages
    def locks_page(self, req: Request) -> Response:
        match = check_glob(req.query.get("key", ""), "key glob")
        task = check_glob(req.query.get("task", ""), "task name")
        cursor = check_cursor(req.query.get("cursor", ""))
        page = self.view.locks(match=match, task=task, cursor=cursor)
        nxt = ""
        if page.next_cursor:
            nxt = "?" + urllib.parse.urlencode(
                {"key": req.query.get("key", ""), "task": req.query.get("task", ""),
                 "cursor": page.next_cursor})  # fmt: skip
        return self.render(req, "locks.html", page=page, key=req.query.get("key", ""),
                           task=req.query.get("task", ""), next=nxt,
                           paging="SCAN cursor" if self.view.pages_with_cursor else "offset",
                           log=list(self.log)[::-1][:20])  # fmt: skip

    def lock_page(self, req: Request) -> Response:
        info = self.view.find(check_key_id(req.query.get("id", "")))
        if info is None:
            why = "it is not held (released or expired); back to the locks page"
            return self._error(req, 404, "no such lock", why)
        row = self.view.row(info, self.view_now())
        return self.render(req, "lock.html", row=row, info=info,
                           highest=self.view.highest_fence(info.key),
                           decisions=self.view.decisions(info.key))  # fmt: skip

    def find_form(self, req: Request) -> Response:
        return self.render(req, "find.html", app=self.app is not None, task="", problem="")

    def find_page(self, req: Request) -> Response:
        """The lock, record and decisions of the job a task name and arguments make: keyed
        here as the worker keys them (the app's key function and secret). A POST, so the
        arguments stay out of URLs and access logs; neither they nor the key secret are
        shown back or logged."""
        task = req.form.get("task", "")
        try:
            key = job_key(self.app, task, req.form.get("arguments", ""),
                          req.form.get("idempotency_key", ""))  # fmt: skip
        except BadInput as exc:
            return self.render(req, "find.html", 400, app=self.app is not None,
                               task=printable(task.strip()[:200]), problem=str(exc))  # fmt: skip
        info = self.backend.inspect(key)
        row = self.view.row(info, self.view_now()) if info is not None else None
        return self.render(req, "job.html", key=key, label=key_label(key, task.strip()),
                           row=row, info=info, record=self.backend.job_record(key),
                           highest=self.view.highest_fence(key),
                           decisions=self.view.decisions(key))  # fmt: skip

    def slots_page(self, req: Request) -> Response:
        return self.render(req, "slots.html", semaphores=self.view.semaphores(),
                           rates=self.view.rate_limits())  # fmt: skip

    def leaders_page(self, req: Request) -> Response:
        return self.render(req, "leaders.html", leaders=self.view.leaders(),
                           beat=beat_rows(self.app))  # fmt: skip

    def records_page(self, req: Request) -> Response:
        task = check_glob(req.query.get("task", ""), "task name")
        records = self.view.records(task=task)
        inflight = self.view.locks(task=task, size=200).rows
        return self.render(req, "records.html", records=records, inflight=inflight,
                           task=req.query.get("task", ""))  # fmt: skip

    def live(self, req: Request) -> Response:
        return Response(200, json.dumps(self.figures()), "application/json")

    def figures(self) -> dict[str, int | None]:
        """Locks held and their verdicts; waits, skips and lost leases from `metrics_url`."""
        counts = live.lock_counts(self.view, self.backend, self.view_now())
        counts.update(live.scraped(self.metrics_url))
        return counts

    def view_now(self) -> float:
        from jobfence.worker.admin import server_time

        return server_time(self.backend)

    # ------------------------------------------------------------------- actions
    def confirm_page(self, req: Request) -> Response:
        info = self.view.find(check_key_id(req.query.get("id", "")))
        if info is None:
            return self._error(req, 404, "no such lock", "it is not held any more; nothing to do")
        row = self.view.row(info, self.view_now())
        cookie = req.cookies.get(COOKIE, "")
        token = self.mint_token("release", row.id, info.fence, cookie) if cookie else ""
        return self.render(req, "confirm.html", row=row, info=info, token=token)

    def mint_token(self, action: str, lock_id: str, fence: int, cookie: str) -> str:
        """A confirmation page's action token (see `actions.ActionTokens`)."""
        return self.tokens.mint(action, lock_id, fence, cookie)

    def _check_token(self, req: Request, action: str, lock_id: str, fence: int) -> str:
        """Empty if the form's token is good for this action, lock, fence and browser; else why."""
        if req.origin and not self._origin_ok(req):  # (`handle` refused it already)
            return "the request came from another site (its Origin is not this dashboard)"
        token, cookie = req.form.get("token", ""), req.cookies.get(COOKIE, "")
        return self.tokens.check(token, cookie, action, lock_id, fence)

    def release(self, req: Request) -> Response:
        """Force-release a provably dead holder's lock and advance its fence."""
        refusal = self._may_act(req)
        if refusal is not None:
            return refusal
        lock_id = check_key_id(req.form.get("id", ""))
        fence_text = req.form.get("fence", "")
        if not fence_text.isdigit():
            raise BadInput("fence must be the number the confirmation page showed; open it again")
        fence = int(fence_text)
        why = self._check_token(req, "release", lock_id, fence)
        if why:
            return self._refused(req, 403, lock_id, fence, why)
        if req.form.get("confirm") != "yes":
            why = "not confirmed: tick the box that says what will happen"
            return self._refused(req, 400, lock_id, fence, why)
        held = self._dead_holder(req, lock_id, fence)
        if isinstance(held, str):
            return self._refused(req, 409, lock_id, fence, held)
        info, row = held
        if not release_grant(self.backend, info.key, fence):
            return self._refused(req, 409, lock_id, fence,
                                 "the lock changed hands while it was being released")  # fmt: skip
        floor = advance_fence(self.backend, info.key)
        self._record(req, "release", row.hidden, fence, f"released; fence advanced to {floor}")
        self._decide(info, fence, floor, req.user)
        return self.render(req, "done.html", row=row, floor=floor)

    def _may_act(self, req: Request) -> Response | None:
        """A 403 if this dashboard is read-only or the request has no login; None if it may."""
        if not self.actions:
            why = "actions are off; start it with --allow-actions to enable them"
            return self._error(req, 403, "read-only dashboard", why)
        if not req.authenticated:
            why = (
                f"actions need a login: set {TOKEN_ENV} (32+ random characters) where the "
                f"dashboard starts and log in with it, or mount it in Django's admin"
            )
            return self._error(req, 403, "action refused", why)
        return None

    def _dead_holder(
        self, req: Request, lock_id: str, fence: int
    ) -> tuple[LockInfo, LockRow] | str:
        """The lock and its row if it is still held as the page showed it (fence, host, pid)
        and its holder is provably dead; else why not."""
        info = self.view.find(lock_id)
        if (
            info is None
            or info.fence != fence
            or (info.host, str(info.pid)) != (req.form.get("host", ""), req.form.get("pid", ""))
        ):
            return "stale view: the holder changed since the page was drawn; nothing was released"
        row = self.view.row(info, self.view_now())
        if row.verdict != "dead":
            return (f"the holder is {row.verdict}, not provably dead ({row.reason}); nothing "
                    "was released")  # fmt: skip
        return info, row

    def _decide(self, info: LockInfo, fence: int, floor: int, user: str) -> None:
        """The force release in the key's decision log, where the backend keeps one (who,
        what, when), so `locks why` and the lock page tell it too."""
        from jobfence.locks.decisions import Decision, DecisionBounds

        try:
            decisions = self.backend.decision_log(DecisionBounds())
            if decisions is not None:
                decisions.append(Decision(time.time(), "forced", info.key, info.task_name,
                                          info.task_id, fence, "", floor,
                                          f"by {printable(user)} from the dashboard"))  # fmt: skip
        except Exception as exc:  # the release happened; only its record in the log is lost
            log.warning("dashboard: decision log not written: %s", type(exc).__name__)

    def _refused(self, req: Request, status: int, lock_id: str, fence: int, why: str) -> Response:
        self._record(req, "release", f"#{lock_id[:12]}", fence, f"refused: {why}")
        return self._error(req, status, "action refused", why)

    def _record(self, req: Request, action: str, lock: str, fence: int, outcome: str) -> None:
        entry = ActionRecord(time.time(), printable(req.user), action, lock, fence, outcome)
        self.log.append(entry)
        log.warning("dashboard: %s by %s on %s (fence %d): %s", action, entry.user, lock, fence,
                    outcome)  # fmt: skip

