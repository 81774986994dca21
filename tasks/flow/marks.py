"""The headers jobfence puts on a message, named, read and written by one type: `Marks`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

#: The explicit idempotency key a publish gave (`apply_async(idempotency_key=...)`).
KEY_HEADER: Final = "jobfence_idempotency_key"
#: How often the job came back because its fate was unknown (apart from Celery's retries).
REDELIVERIES_HEADER: Final = "jobfence_redeliveries"
#: Set on the copy a delivery publishes when its own earlier delivery holds the lease (it
#: crashed, or still runs): a grant of that copy counts towards the poison cap.
DEFERRED_HEADER: Final = "jobfence_deferred"
#: Set on every copy of a delivered message published again (a requeue, a rate turn, a
#: deferred copy, a redelivery, a retry): its publish makes no claim, so the copy is never
#: de-duplicated away against a newer publish.
REPUBLISHED_HEADER: Final = "jobfence_republished"
#: Set on the copy a rate-limited delivery publishes: the server time of the turn it
#: reserved, so the copy starts then without spending another.
RATE_SLOT_HEADER: Final = "jobfence_rate_slot"
#: The header a broker sets on a message it delivers again (kombu's Redis transport).
BROKER_REDELIVERED: Final = "redelivered"
#: Every header jobfence writes.
HEADERS: Final = (KEY_HEADER, REDELIVERIES_HEADER, DEFERRED_HEADER, REPUBLISHED_HEADER,
                  RATE_SLOT_HEADER)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Marks:
    """jobfence's marks on one message: its explicit key, how often its fate was unknown,
    whether it is a deferred copy, the rate turn reserved for it."""

    key: str | None = None
    redeliveries: int = 0
    deferred: bool = False
    rate_slot: float | None = None

    @classmethod
    def read(cls, headers: Mapping[str, Any] | None, fields: Mapping[str, Any] = {}) -> Marks:
        """The marks of a delivered message: from its headers, or (as Celery may expose a
        message's custom headers) the request's own attributes (`fields`)."""
        h = headers or {}
        key = h.get(KEY_HEADER) or fields.get(KEY_HEADER)
        count = h.get(REDELIVERIES_HEADER) or fields.get(REDELIVERIES_HEADER)
        deferred = h.get(DEFERRED_HEADER) or fields.get(DEFERRED_HEADER)
        slot = h.get(RATE_SLOT_HEADER) or fields.get(RATE_SLOT_HEADER)
        if not (key or count or deferred or slot):
            return UNMARKED  # a first delivery's message: no marks to build
        return cls(key or None, int(count or 0), bool(deferred), float(slot) if slot else None)

    @staticmethod
    def republished(headers: Mapping[str, Any]) -> bool:
        """Whether a publish carries a delivered message again (it holds or held its claim)."""
        return bool(headers.get(REPUBLISHED_HEADER)) or REDELIVERIES_HEADER in headers

    def copy(
        self, *, redeliveries: int | None = None, deferred: bool = False,
        rate_slot: float | None = None,
    ) -> Marks:  # fmt: skip
        """The marks of this message's copy: the same key and count (or `redeliveries`);
        neither the crash mark nor a rate turn is inherited (a turn is spent by the copy
        it was made for, and a redelivery never counts towards the poison cap by descent)."""
        count = self.redeliveries if redeliveries is None else redeliveries
        return Marks(self.key, count, deferred, rate_slot)

    def onto(self, headers: Mapping[str, Any] | None) -> dict[str, Any]:
        """`headers` (the delivered message's) with these marks in place of its own, marked
        as a copy published again. The broker's `redelivered` flag (kombu's Redis transport
        sets it on a message it restores, custody on one it puts back) is not inherited: the
        copy is a new message, and a copy of a once-restored message counted as a crash at
        every grant (a job requeued behind a slot five times was dead-lettered, with no crash)."""
        out = {k: v for k, v in (headers or {}).items()
               if k not in HEADERS and k != BROKER_REDELIVERED}  # fmt: skip
        if self.key:
            out[KEY_HEADER] = self.key
        if self.redeliveries:
            out[REDELIVERIES_HEADER] = self.redeliveries
        if self.deferred:
            out[DEFERRED_HEADER] = 1
        if self.rate_slot is not None:
            out[RATE_SLOT_HEADER] = self.rate_slot
        out[REPUBLISHED_HEADER] = 1
        return out


#: A message with no marks (a first delivery with no explicit key).
UNMARKED: Final = Marks()
