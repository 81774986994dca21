"""Every jobfence task option, defined once: its name, type, default, check and doc line.

`TaskOptions` is the table: one field per option. From it come `@singleton_task`'s keyword
validation and the options its task class holds (tasks/celery_task.py), the `SingletonTask`
and `FencedTask` attributes (`OptionAttribute`), the `JobSpec` fields the options set
(`TaskOptions.job_fields`), and the Django task's options (tasks/django_tasks.py). A keyword
that is neither an option here nor one Celery takes is refused with the nearest name.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, get_args

from jobfence.locks.errors import LockError
from jobfence.locks.ratelimit import Rate, parse_rate
from jobfence.tasks.celery_keywords import celery_keywords
from jobfence.tasks.errors import TaskDefinitionError
from jobfence.tasks.keys import KeySelector, check_key_names, normalise_key

if TYPE_CHECKING:
    from jobfence.config import Settings

ConflictPolicy = Literal["skip", "wait", "retry", "raise", "supersede"]
CONFLICT_POLICIES: tuple[str, ...] = get_args(ConflictPolicy)
#: A Django task has no Celery retry to come back through, nor a publish claim to tell the
#: newest publish by: every policy but "retry" and "supersede".
DJANGO_CONFLICT_POLICIES: tuple[str, ...] = tuple(
    p for p in CONFLICT_POLICIES if p not in ("retry", "supersede")
)
LeaseLostPolicy = Literal["redeliver", "drop"]
LEASE_LOST_POLICIES: tuple[str, ...] = get_args(LeaseLostPolicy)
LockUntil = Literal["finish", "start"]
LOCK_UNTIL: tuple[str, ...] = get_args(LockUntil)
DuplicatePublishPolicy = Literal["result", "raise", "replace"]
DUPLICATE_PUBLISH_POLICIES: tuple[str, ...] = get_args(DuplicatePublishPolicy)
RateLimitedPolicy = Literal["retry", "skip", "wait"]
RATE_LIMITED_POLICIES: tuple[str, ...] = get_args(RateLimitedPolicy)

Check = Callable[[str, Any], Any]  # (option name, value) -> the value kept, or refused


def check_seconds(name: str, value: Any, *, zero: bool = False) -> Any:
    """Refuse an option of seconds that is no finite number > 0 (>= 0 with `zero`); None
    (the setting's default) passes. NaN passes every `<=` test and inf overflows a TTL."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        problem = f"a number of seconds, got {type(value).__name__}"
    elif not math.isfinite(value):
        problem = f"a finite number of seconds, got {value!r}"
    elif value < 0 or (value == 0 and not zero):
        problem = f"{'non-negative' if zero else 'positive'} seconds, got {value!r}"
    else:
        return value
    raise TaskDefinitionError(
        f"{name} must be {problem}; pass e.g. {name}=30, or leave it out for the default"
    )


def _seconds_or_zero(name: str, value: Any) -> Any:
    return check_seconds(name, value, zero=True)


def _one_of(choices: tuple[str, ...], hint: str = "") -> Check:
    def check(name: str, value: Any) -> Any:
        if value not in choices:
            raise TaskDefinitionError(f"{name} must be one of {choices}, got {value!r}{hint}")
        return value

    return check


def _count(name: str, value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TaskDefinitionError(
            f"{name} must be a positive integer (at most that many jobs of a group at "
            f"once), or 0 for no limit; got {value!r}"
        )
    return value


def _as_given(name: str, value: Any) -> Any:
    return value


def _row(
    doc: str, check: Check = _as_given, *, attribute: str = "", django: bool = False
) -> dict[str, Any]:
    """One option's row of the table: `attribute` is the task class's name for it where that
    is not the keyword; `django`: a Django task takes it too (the rest act at publish, or
    through Celery)."""
    return {"doc": doc, "check": check, "attribute": attribute, "django": django}


@dataclass(frozen=True, kw_only=True)
class TaskOptions:
    """A task's jobfence options, checked: one field per option, in the order they are checked."""

    key: KeySelector = field(default=None, metadata=_row(
        "the argument name, argument names or callable that make a job unique (None: every "
        "argument)", normalise_key, attribute="jobfence_key", django=True))  # fmt: skip
    ttl: float | None = field(default=None, metadata=_row(
        "the lease TTL in seconds (None: JOBFENCE_DEFAULT_TTL)", check_seconds,
        attribute="jobfence_ttl", django=True))  # fmt: skip
    on_conflict: ConflictPolicy = field(default="skip", metadata=_row(
        "a copy of the job holds the key: skip, wait, retry, raise, or supersede (the newest "
        "publish takes the key from the running copy, with a higher fence; sets "
        "dedupe_on_publish, on_duplicate_publish='replace' and lock_until='start'; a Django "
        "task: neither retry nor supersede)", _one_of(CONFLICT_POLICIES), django=True))  # fmt: skip
    on_lease_lost: LeaseLostPolicy = field(default="redeliver", metadata=_row(
        "the lease is lost mid-body: redeliver (run it again) or drop (at most once)",
        _one_of(LEASE_LOST_POLICIES, "; 'drop' runs the job at most once, 'redeliver' (the "
                "default) never loses it"), django=True))  # fmt: skip
    wait_timeout: float | None = field(default=None, metadata=_row(
        "seconds a wait (on_conflict, a slot, a rate turn) may last "
        "(None: JOBFENCE_ACQUIRE_TIMEOUT)", _seconds_or_zero, django=True))  # fmt: skip
    result_ttl: float | None = field(default=None, metadata=_row(
        "seconds the DONE record answers (None: JOBFENCE_RESULT_TTL)", check_seconds,
        django=True))  # fmt: skip
    dedupe_on_publish: bool = field(
        default=False,
        metadata=_row("a duplicate publish answers with the queued or running copy's AsyncResult"),
    )
    dedupe_ttl: float | None = field(default=None, metadata=_row(
        "seconds the publish claim lasts, plus the countdown "
        "(None: JOBFENCE_VISIBILITY_TIMEOUT)", check_seconds))  # fmt: skip
    lock_until: LockUntil = field(default="finish", metadata=_row(
        "the publish claim is kept until the run finishes, or until it starts",
        _one_of(LOCK_UNTIL, "; for a key held a fixed time after the run, use "
                "unique_for=<seconds>")))  # fmt: skip
    unique_for: float | None = field(
        default=None,
        metadata=_row(
            "seconds the key stays taken after the run finished", check_seconds, django=True
        ),
    )
    debounce: float | None = field(default=None, metadata=_row(
        "seconds with no newer publish before a burst of publishes of one key runs once, with "
        "the latest arguments (sets dedupe_on_publish, on_duplicate_publish='replace', "
        "lock_until='start' and on_conflict='wait' unless given)", check_seconds))  # fmt: skip
    debounce_max_wait: float | None = field(default=None, metadata=_row(
        "the longest a debounced burst waits after its first publish (None: no bound)",
        check_seconds))  # fmt: skip
    on_duplicate_publish: DuplicatePublishPolicy = field(default="result", metadata=_row(
        "what a duplicate publish gets: the result, raise, or replace the queued copy",
        _one_of(DUPLICATE_PUBLISH_POLICIES)))  # fmt: skip
    concurrency: int = field(default=0, metadata=_row(
        "at most this many jobs of one group at once across the fleet (0: no limit)", _count,
        django=True))  # fmt: skip
    concurrency_key: KeySelector = field(default=None, metadata=_row(
        "the arguments that name the concurrency group (None: the whole task)",
        normalise_key, django=True))  # fmt: skip
    global_rate_limit: str | None = field(
        default=None,
        metadata=_row('at most this many starts across the fleet: "N/s", "N/m" or "N/h"'),
    )
    rate_key: KeySelector = field(
        default=None,
        metadata=_row(
            "the arguments that name the rate limiter (None: the whole task)", normalise_key
        ),
    )
    rate_burst: int = field(
        default=1, metadata=_row("starts the rate limit lets through at once after a lull")
    )
    on_rate_limited: RateLimitedPolicy = field(default="retry", metadata=_row(
        "no rate turn free: retry (at its turn), wait (in the worker) or skip",
        _one_of(RATE_LIMITED_POLICIES)))  # fmt: skip
    #: The parsed global rate limit (with its burst), None without one; not an option.
    rate: Rate | None = field(default=None, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        for f in OPTIONS:
            value = f.metadata["check"](f.name, getattr(self, f.name))
            object.__setattr__(self, f.name, value)
        self._check_together()

    def _check_together(self) -> None:
        """Refuse options that cannot work together; parse the rate limit."""
        self._derive_debounce()
        self._derive_supersede()
        if self.unique_for is not None and self.lock_until == "start":
            raise TaskDefinitionError(
                "unique_for keeps the key until a time after the run finishes; it cannot be "
                "combined with lock_until='start' (which frees it when the run starts): pick one"
            )
        if self.lock_until == "start" and self.on_conflict == "skip":
            raise TaskDefinitionError(
                "lock_until='start' lets a newer copy queue behind the running one, and "
                "on_conflict='skip' would drop that copy when it arrives during the run; "
                "use on_conflict='wait' or 'retry'"
            )
        if self.on_duplicate_publish != "result" and not self.dedupe_on_publish:
            raise TaskDefinitionError(
                f"on_duplicate_publish={self.on_duplicate_publish!r} acts on the publish claim, "
                "which only dedupe_on_publish=True makes; set dedupe_on_publish=True"
            )
        if self.concurrency_key is not None and not self.concurrency:
            raise TaskDefinitionError(
                "concurrency_key names a group but concurrency= sets no limit; add concurrency=N"
            )
        if self.global_rate_limit is None:
            if self.rate_key is not None:
                raise TaskDefinitionError("rate_key is given without global_rate_limit; set both")
            return
        try:
            rate = parse_rate(self.global_rate_limit, option="global_rate_limit",
                              burst=self.rate_burst)  # fmt: skip
        except LockError as exc:
            raise TaskDefinitionError(str(exc).replace("burst", "rate_burst")) from None
        object.__setattr__(self, "rate", rate)

    def _derive_debounce(self) -> None:
        """`debounce` needs the claim, "replace" and lock_until="start" (docs/how-to/
        debounce.md): set them; refuse an option given against them, naming it."""
        if self.debounce is None:
            if self.debounce_max_wait is not None:
                raise TaskDefinitionError(
                    "debounce_max_wait bounds a debounced burst; set debounce=<seconds> too"
                )
            return
        if self.debounce_max_wait is not None and self.debounce_max_wait < self.debounce:
            raise TaskDefinitionError(
                f"debounce_max_wait={self.debounce_max_wait!r} is shorter than "
                f"debounce={self.debounce!r}: a burst could never wait its quiet period; "
                "make debounce_max_wait at least debounce"
            )
        against = {
            "on_duplicate_publish": self.on_duplicate_publish not in ("result", "replace"),
            "unique_for": self.unique_for is not None,
            "on_conflict": self.on_conflict in ("raise", "supersede"),
        }
        for name, bad in against.items():
            if bad:
                raise TaskDefinitionError(
                    f"debounce runs the latest publish of a burst and the next burst after "
                    f"it; {name}={getattr(self, name)!r} works against that: leave {name} out"
                )
        conflict = "wait" if self.on_conflict == "skip" else self.on_conflict
        for name, value in (("dedupe_on_publish", True), ("on_duplicate_publish", "replace"),
                            ("lock_until", "start"), ("on_conflict", conflict)):  # fmt: skip
            object.__setattr__(self, name, value)

    def _derive_supersede(self) -> None:
        """on_conflict="supersede" needs the publish claim (it names the newest publish),
        "replace" and a run per publish (docs/how-to/supersede.md): set them; refuse an
        option given against them, naming it."""
        if self.on_conflict != "supersede":
            return
        against = {
            "on_duplicate_publish": self.on_duplicate_publish not in ("result", "replace"),
            "unique_for": self.unique_for is not None,
        }
        for name, bad in against.items():
            if bad:
                raise TaskDefinitionError(
                    f"on_conflict='supersede' runs every newest publish, stopping the run it "
                    f"replaces; {name}={getattr(self, name)!r} works against that: leave "
                    f"{name} out"
                )
        for name, value in (("dedupe_on_publish", True), ("on_duplicate_publish", "replace"),
                            ("lock_until", "start")):  # fmt: skip
            object.__setattr__(self, name, value)

    @property
    def replaces_started(self) -> bool:
        """A publish replaces the claim of a started run too, and a run keeps its claim's
        mark (debounce: that run ended the last burst; supersede: the newest publish wins)."""
        return self.debounce is not None or self.on_conflict == "supersede"

    def check_names(self, func: Callable[..., Any], *, bound: bool) -> None:
        """Refuse, at decoration, a key selector naming no parameter of `func` (`bound`: its
        first parameter is the task or a context, never part of a key)."""
        for f in SELECTORS:
            check_key_names(func, getattr(self, f.name), bound=bound, name=f.name)

    def lease_ttl(self, default_ttl: float) -> float:
        """The TTL of the task's leases: its own `ttl`, else `default_ttl` (the settings')."""
        return self.ttl or default_ttl

    def job_fields(self, settings: Settings) -> dict[str, Any]:
        """The `JobSpec` fields these options set, the settings filling in what they leave
        unset (None). The publish claim's fields are the Celery task's (it publishes)."""
        wait = settings.acquire_timeout if self.wait_timeout is None else self.wait_timeout
        return {
            "ttl": self.lease_ttl(settings.default_ttl),
            "result_ttl": self.result_ttl or settings.result_ttl,
            "on_conflict": self.on_conflict,
            "wait_timeout": wait,
            "on_lease_lost": self.on_lease_lost,
            "lock_until": self.lock_until,
            "unique_for": self.unique_for or 0.0,
            "concurrency": self.concurrency,
        }


#: The table's rows, in the order they are checked (the derived `rate` is no option).
OPTIONS: tuple[dataclasses.Field[Any], ...] = tuple(
    f for f in dataclasses.fields(TaskOptions) if f.init
)
OPTION_NAMES: tuple[str, ...] = tuple(f.name for f in OPTIONS)
#: The options a Django task takes (the rest act at publish, or through Celery).
DJANGO_OPTION_NAMES: tuple[str, ...] = tuple(f.name for f in OPTIONS if f.metadata["django"])
#: The options that select arguments (a key, a group, a limiter).
SELECTORS = tuple(f for f in OPTIONS if f.metadata["check"] is normalise_key)
DEFAULTS = TaskOptions()


def attribute_of(f: dataclasses.Field[Any]) -> str:
    """The task class attribute that carries option `f`."""
    return str(f.metadata["attribute"] or f.name)


class OptionAttribute:
    """A task class attribute read from the class's `TaskOptions` (its `holder` attribute):
    `task.on_conflict`, `task.jobfence_key`. Set on an instance, it shadows as any attribute."""

    def __init__(self, option: str, holder: str) -> None:
        self.option, self.holder = option, holder

    def __get__(self, obj: object, owner: type | None = None) -> Any:
        return getattr(getattr(obj if obj is not None else owner, self.holder), self.option)


def add_option_attributes(
    cls: type, holder: str, names: Iterable[str] = OPTION_NAMES, *, renamed: bool = True
) -> None:
    """Give `cls` one attribute per option in `names`, read from its `holder` TaskOptions;
    named as the Celery task names them (`renamed`: `jobfence_key` for `key`), else as the
    keyword."""
    for f in OPTIONS:
        if f.name in names:
            setattr(cls, attribute_of(f) if renamed else f.name, OptionAttribute(f.name, holder))


def _did_you_mean(name: str, known: Iterable[str]) -> str:
    close = [ALIASES[name]] if name in ALIASES else difflib.get_close_matches(name, known, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


#: The task class attributes spelled apart from their keyword, to the keyword.
ALIASES = {attribute_of(f): f.name for f in OPTIONS if attribute_of(f) != f.name}


def refuse_unknown(where: str, unknown: Iterable[str], known: Iterable[str], why: str) -> None:
    """Refuse keywords that are no option of `where`, each with the nearest known name."""
    names, pool = sorted(unknown), sorted(set(known))
    if names:
        each = ", ".join(f"{n!r}{_did_you_mean(n, pool)}" for n in names)
        raise TaskDefinitionError(f"{where} takes no {each}: {why}")


def django_options(given: Mapping[str, Any]) -> TaskOptions:
    """The options of a Django task, checked: the table's, less those that act at publish or
    through Celery, and no "retry" (a Django task has no Celery retry to come back through)."""
    publish = sorted(set(given) & set(OPTION_NAMES) - set(DJANGO_OPTION_NAMES))
    if publish:
        raise TaskDefinitionError(
            f"a Django task takes no {', '.join(publish)}: @singleton_task's options that act "
            "at publish or through Celery; a Django task takes "
            f"{', '.join(DJANGO_OPTION_NAMES)}"
        )
    policy = given.get("on_conflict", DEFAULTS.on_conflict)
    if policy not in DJANGO_CONFLICT_POLICIES:
        hint = {
            "retry": "; 'retry' is a Celery retry, which a Django task has not: use 'wait' or "
                     "'skip'",
            "supersede": "; 'supersede' tells the newest publish by its publish claim, which a "
                         "Django task's enqueue does not make: use 'wait' or 'skip', or a Celery "
                         "task",
        }.get(policy, "")
        raise TaskDefinitionError(
            f"on_conflict must be one of {DJANGO_CONFLICT_POLICIES}, got {policy!r}{hint}"
        )
    return TaskOptions(**given)


def split_options(given: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(jobfence options, the other keywords) of `given`."""
    mine = {k: v for k, v in given.items() if k in OPTION_NAMES}
    return mine, {k: v for k, v in given.items() if k not in mine}


def celery_option_names(base: type) -> frozenset[str]:
    """The keywords Celery's `app.task` and `shared_task` take for a task of class `base`: its
    public attributes (a keyword becomes one) and `celery_keywords()`. The attributes the
    jobfence options set are not among them: those keywords are the table's."""
    ours = {attribute_of(f) for f in OPTIONS} | {"jobfence_options"}
    return frozenset({n for n in dir(base) if not n.startswith("_")} - ours) | celery_keywords()
