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
the token's, or the shell's own (Django's staff login)."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
import threading
import time
import urllib.parse
import urllib.request
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

import jinja2
import markupsafe

from jobfence.locks import LockBackend, LockError, LockInfo
from jobfence.worker.admin import advance_fence, printable, release_grant
from jobfence.worker.dashboard.data import (
    BadInput,
    LockView,
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

log = logging.getLogger("jobfence.dashboard")

COOKIE = "jobfence_dash"  # the browser's random id, which action tokens are bound to
TOKEN_TTL = 600.0  # seconds a confirmation page's token stays good
LIVE_METRICS = {  # live figure -> the metric whose samples are summed
    "waits": "jobfence_acquire_wait_seconds_count",
    "skips": "jobfence_conflicts_total",
    "lost_leases": "jobfence_lost_leases_total",
}


@dataclass(frozen=True)
class Request:
    """What a page needs of an HTTP request. `root` is where the dashboard is mounted."""

    method: str
    path: str  # below root: "/", "/lock", ...
    query: Mapping[str, str] = field(default_factory=dict)
    form: Mapping[str, str] = field(default_factory=dict)
    cookies: Mapping[str, str] = field(default_factory=dict)
    origin: str = ""  # the Origin header, if the browser sent one
    host: str = ""  # the Host header
    root: str = ""
    user: str = "anonymous"  # who acts, for the action log (Django: the admin user)
    csrf_input: str = ""  # a shell's own CSRF field (Django's), put into every form
    authorization: str = ""  # the Authorization header ("Bearer <token>")
    host_checked: bool = False  # the shell vetted the Host (Django's ALLOWED_HOSTS)
    authenticated: bool = False  # the shell's own login passed (Django's staff login)


@dataclass
class Response:
    status: int
    body: str
    content_type: str = "text/html; charset=utf-8"
    set_cookie: tuple[str, str] | None = None  # (name, value), HttpOnly, SameSite=Strict
    login_cookie: str | None = None  # set it (HttpOnly, SameSite=Strict); "" clears it
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ActionRecord:
    """One action in the log: who, what, when, and what came of it (no key: its label)."""

    when: float
    user: str
    action: str
    lock: str
    fence: int
    outcome: str


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
        self.log: deque[ActionRecord] = deque(maxlen=200)
        self._used: dict[str, float] = {}  # nonces of tokens spent, until they expire
        self._lock = threading.Lock()
        loader = jinja2.PackageLoader("jobfence.worker.dashboard", "templates")
        self.env = jinja2.Environment(
            loader=loader, autoescape=True, undefined=jinja2.StrictUndefined
        )
        self.env.filters["when"] = _when
        self.env.filters["secs"] = _secs

    # ------------------------------------------------------------------- dispatch
    def handle(self, req: Request) -> Response:
        if not req.host_checked and not self.hosts.allows(req.host):
            return _plain(421, f"421 Misdirected Request: this dashboard does not answer to the "
                               f"host name {printable(req.host)!r}. If that is the name you "
                               f"browse it by, start it with --allowed-host NAME.")  # fmt: skip
        if req.method.upper() == "POST" and req.origin and not self._origin_ok(req):
            return _plain(403, "403 Forbidden: the request came from another site (its Origin "
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
            nxt = _safe_next(req.form.get("next", "/"))
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
        resp = _redirect(req, _safe_next(req.form.get("next", "/")))
        resp.login_cookie = self.login.mint_cookie()
        return resp

    def logged_in(self, req: Request) -> Response:
        """/login once logged in (by the token, or the shell): on to the page asked for."""
        if self.login is None and not req.authenticated:
            return self._error(req, 404, "no such page", "this dashboard has no login")
        return _redirect(req, _safe_next(req.form.get("next", req.query.get("next", "/"))))

    def logout(self, req: Request) -> Response:
        resp = _redirect(req, "/")
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
                           beat=self.beat_rows())  # fmt: skip

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
        now = self.view_now()
        counts: dict[str, int | None] = {"locks": 0, "dead": 0, "stopped": 0, "suspect": 0}
        for n, info in enumerate(self.backend.scan("*")):
            if n >= 10_000:
                break
            counts["locks"] = n + 1
            verdict = self.view.row(info, now).verdict
            if verdict in counts:
                counts[verdict] = (counts[verdict] or 0) + 1
        counts.update(self.scraped())
        return counts

    def scraped(self) -> dict[str, int | None]:
        if not self.metrics_url:
            return dict.fromkeys(LIVE_METRICS)
        from prometheus_client.parser import text_string_to_metric_families

        sums = dict.fromkeys(LIVE_METRICS.values(), 0.0)
        try:
            with urllib.request.urlopen(self.metrics_url, timeout=2) as resp:
                text = resp.read().decode()
        except OSError:
            return dict.fromkeys(LIVE_METRICS)
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in sums:
                    sums[sample.name] += sample.value
        return {k: int(sums[m]) for k, m in LIVE_METRICS.items()}

    def beat_rows(self) -> list[dict[str, str]] | None:
        """Each beat entry's latest due slot (its idempotency key) and next one; None if no app."""
        if self.app is None:
            return None
        from celery.beat import ScheduleEntry

        from jobfence.worker.beat_slots import format_slot, slot_time

        rows = []
        for name, spec in sorted((self.app.conf.beat_schedule or {}).items()):
            entry = ScheduleEntry(name=name, task=spec["task"], schedule=spec["schedule"],
                                  app=self.app)  # fmt: skip
            now = entry.default_now()
            slot = slot_time(entry, now)
            nxt = now + entry.schedule.remaining_estimate(slot)
            rows.append({"name": printable(name), "task": printable(spec["task"]),
                         "slot": f"{printable(name)}@{format_slot(slot)}",
                         "next": format_slot(nxt)})  # fmt: skip
        return rows

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
        issued, nonce = f"{time.time():.0f}", secrets.token_hex(8)
        return f"{issued}.{nonce}.{self._mac(action, lock_id, fence, cookie, issued, nonce)}"

    def _mac(self, *parts: object) -> str:
        msg = "\n".join(str(p) for p in parts).encode()
        return hmac.new(self.secret, msg, hashlib.sha256).hexdigest()

    def _check_token(self, req: Request, action: str, lock_id: str, fence: int) -> str:
        """Empty if the form's token is good for this action, lock, fence and browser; else why."""
        if req.origin and not self._origin_ok(req):  # (`handle` refused it already)
            return "the request came from another site (its Origin is not this dashboard)"
        token, cookie = req.form.get("token", ""), req.cookies.get(COOKIE, "")
        issued, _, rest = token.partition(".")
        nonce, _, mac = rest.partition(".")
        if not (token and cookie and issued.isdigit()):
            return "the form's cross-site token is missing; open the confirmation page again"
        if not hmac.compare_digest(mac, self._mac(action, lock_id, fence, cookie, issued, nonce)):
            return "the form's cross-site token is not valid for this lock and browser"
        now = time.time()
        if now - int(issued) > TOKEN_TTL:
            return "the confirmation page has expired; open it again"
        with self._lock:
            for old in [n for n, t in self._used.items() if t < now]:
                del self._used[old]
            if nonce in self._used:
                return (
                    "this form was submitted already (a replay); open the confirmation page again"
                )
            self._used[nonce] = int(issued) + TOKEN_TTL
        return ""

    def release(self, req: Request) -> Response:
        """Force-release a provably dead holder's lock and advance its fence."""
        if not self.actions:
            why = "actions are off; start it with --allow-actions to enable them"
            return self._error(req, 403, "read-only dashboard", why)
        if not req.authenticated:
            why = (
                f"actions need a login: set {TOKEN_ENV} (32+ random characters) where the "
                f"dashboard starts and log in with it, or mount it in Django's admin"
            )
            return self._error(req, 403, "action refused", why)
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
        info = self.view.find(lock_id)
        if (
            info is None
            or info.fence != fence
            or (info.host, str(info.pid)) != (req.form.get("host", ""), req.form.get("pid", ""))
        ):
            return self._refused(req, 409, lock_id, fence,
                                 "stale view: the holder changed since the page was drawn; "
                                 "nothing was released")  # fmt: skip
        row = self.view.row(info, self.view_now())
        if row.verdict != "dead":
            return self._refused(req, 409, lock_id, fence,
                                 f"the holder is {row.verdict}, not provably dead "
                                 f"({row.reason}); nothing was released")  # fmt: skip
        if not release_grant(self.backend, info.key, fence):
            return self._refused(req, 409, lock_id, fence,
                                 "the lock changed hands while it was being released")  # fmt: skip
        floor = advance_fence(self.backend, info.key)
        self._record(req, "release", row.hidden, fence, f"released; fence advanced to {floor}")
        self._decide(info, fence, floor, req.user)
        return self.render(req, "done.html", row=row, floor=floor)

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


def _plain(status: int, text: str) -> Response:
    """A refusal before the login: plain text, nothing of the lock server in it."""
    return Response(status, text + "\n", "text/plain; charset=utf-8")


def _safe_next(nxt: str) -> str:
    """A page below the dashboard's root to go on to after the login; "/" for anything else
    (another site, a scheme, a backslash or control character)."""
    if not nxt.startswith("/") or nxt.startswith("//") or any(c in nxt for c in "\\\r\n\t"):
        return "/"
    return nxt


def _redirect(req: Request, below_root: str) -> Response:
    return Response(303, "", headers={"Location": (req.root or "") + below_root})


def _when(epoch: float) -> str:
    if not epoch:
        return "-"
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _secs(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}s"
