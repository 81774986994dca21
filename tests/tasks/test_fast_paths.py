"""The gated call's hand-built shortcuts (issue 32's speed target) give what the plain
construction gives: a context, an owner's meta, a TTL, an HMAC, a message's marks."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import math

import pytest

from jobfence.locks.errors import LockError
from jobfence.locks.lease import OwnerMeta
from jobfence.locks.validation import default_meta, validate_seconds, validate_ttl
from jobfence.tasks.context import JobContext
from jobfence.tasks.flow.marks import UNMARKED, Marks
from jobfence.tasks.keys import _hmac


def test_a_context_filled_directly_is_the_generated_init_s() -> None:
    previous = (("old-key", "old-fp"),)
    fast = JobContext.of("k", "fp", None, "t-1", None, previous)  # type: ignore[arg-type]
    plain = JobContext(key="k", fingerprint="fp", lease=None, task_id="t-1",  # type: ignore[arg-type]
                       previous=previous)  # fmt: skip
    assert vars(fast) == vars(plain)
    assert list(vars(fast)) == [f.name for f in dataclasses.fields(JobContext)]
    assert fast.outer is not plain.outer and fast.effects == []
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.key = "other"  # type: ignore[misc]


def test_an_owner_meta_filled_directly_is_the_generated_init_s() -> None:
    meta = default_meta("t-1", "tests.job")
    process = default_meta()
    assert meta == OwnerMeta(process.host, process.pid, "t-1", "tests.job", process.process_start)
    assert hash(meta) == hash(OwnerMeta(process.host, process.pid, "t-1", "tests.job",
                                        process.process_start))  # fmt: skip


@pytest.mark.parametrize("ttl", [0.001, 0.0015, 1.0, 30.0, 1e9, 2.5e-3])
def test_a_float_ttl_takes_the_short_way_to_the_same_milliseconds(ttl: float) -> None:
    assert validate_ttl(ttl) == int(validate_seconds(ttl, "ttl", positive=True) * 1000)


@pytest.mark.parametrize("ttl", [0.0, -1.0, 0.0009, math.nan, math.inf, -math.inf])
def test_a_bad_float_ttl_is_still_refused(ttl: float) -> None:
    with pytest.raises(LockError):
        validate_ttl(ttl)


@pytest.mark.parametrize("secret", [b"k", b"x" * 64, b"y" * 65, bytes(range(200))])
def test_the_hmac_from_absorbed_pads_is_hmac_sha256(secret: bytes) -> None:
    for text in ("", "tests.job\n{}", "é" * 100):
        assert _hmac(secret, text) == hmac.new(secret, text.encode(), hashlib.sha256).hexdigest()


def test_an_unmarked_message_reads_as_no_marks() -> None:
    assert Marks.read(None, {}) is UNMARKED
    assert Marks.read({"other": 1}, {"id": "t-1"}) == Marks()
    assert Marks.read({}, {"jobfence_redeliveries": "2"}) == Marks(redeliveries=2)
