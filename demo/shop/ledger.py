"""The example domain in SQL: accounts, payments, stock, reservations; seeding and validation."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    Column,
    Connection,
    DateTime,
    Engine,
    Executable,
    ForeignKey,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    func,
    select,
    update,
)
from sqlalchemy.exc import IntegrityError, OperationalError, ProgrammingError

from jobfence.config.errors import JobfenceError
from jobfence.tasks.context import JobContext
from jobfence.tasks.effects import SqlEffects
from jobfence.tasks.errors import IdempotencyConflict

ID_MAX = 128
AMOUNT_MAX = 10**15  # well inside JSON's exact integers (2**53)
QTY_MAX = 10**9

# Active ISO 4217 codes (2024). Tests and demos may add their own with KNOWN_CURRENCIES.add().
KNOWN_CURRENCIES: set[str] = set(
    """
    AED AFN ALL AMD ANG AOA ARS AUD AWG AZN BAM BBD BDT BGN BHD BIF BMD BND BOB BRL BSD BTN
    BWP BYN BZD CAD CDF CHF CLP CNY COP CRC CUP CVE CZK DJF DKK DOP DZD EGP ERN ETB EUR FJD
    FKP GBP GEL GHS GIP GMD GNF GTQ GYD HKD HNL HTG HUF IDR ILS INR IQD IRR ISK JMD JOD JPY
    KES KGS KHR KMF KPW KRW KWD KYD KZT LAK LBP LKR LRD LSL LYD MAD MDL MGA MKD MMK MNT MOP
    MRU MUR MVR MWK MXN MYR MZN NAD NGN NIO NOK NPR NZD OMR PAB PEN PGK PHP PKR PLN PYG QAR
    RON RSD RUB RWF SAR SBD SCR SDG SEK SGD SHP SLE SLL SOS SRD SSP STN SVC SYP SZL THB TJS
    TMT TND TOP TRY TTD TWD TZS UAH UGX USD UYU UZS VES VND VUV WST XAF XCD XCG XOF XPF YER
    ZAR ZMW ZWG
    """.split()  # noqa: SIM905
)
_CURRENCY_FORMAT = re.compile(r"[A-Z]{3}")

metadata = MetaData()

accounts = Table(
    "accounts",
    metadata,
    Column("account", String(ID_MAX), primary_key=True),
    Column("currency", String(3), nullable=False),
    Column("balance_cents", BigInteger, nullable=False),
    Column("opened_at", DateTime(timezone=True), nullable=False),
)

payments = Table(
    "payments",
    metadata,
    Column("payment_id", String(ID_MAX), primary_key=True),  # unique: one row per payment
    Column("account", String(ID_MAX), ForeignKey("accounts.account"), nullable=False),
    Column("amount_cents", BigInteger, nullable=False),
    Column("currency", String(3), nullable=False),
    Column("balance_after_cents", BigInteger, nullable=False),
    Column("fence", BigInteger, nullable=False),  # the lease fence that wrote the row
    Column("created_at", DateTime(timezone=True), nullable=False),
    CheckConstraint("amount_cents > 0", name="payments_amount_positive"),
)

stock = Table(
    "stock",
    metadata,
    Column("sku", String(ID_MAX), primary_key=True),
    Column("received", BigInteger, nullable=False),  # initial level plus later receipts
    Column("quantity", BigInteger, nullable=False),  # on hand: received - reserved
    Column("updated_at", DateTime(timezone=True), nullable=False),
    CheckConstraint("quantity >= 0", name="stock_never_negative"),
)

reservations = Table(
    "reservations",
    metadata,
    Column("order_id", String(ID_MAX), primary_key=True),  # an order is reserved once
    Column("sku", String(ID_MAX), ForeignKey("stock.sku"), nullable=False),
    Column("qty", BigInteger, nullable=False),
    Column("fence", BigInteger, nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False),
    CheckConstraint("qty > 0", name="reservations_qty_positive"),
)

stock_reconciliations = Table(
    "stock_reconciliations",
    metadata,
    Column("job_key", String(255), primary_key=True),  # one report per scheduled slot
    Column("skus_checked", Integer, nullable=False),
    Column("mismatches", Integer, nullable=False),
    Column("report", Text, nullable=False),  # the job's result, as JSON
    Column("fence", BigInteger, nullable=False),
    Column("checked_at", DateTime(timezone=True), nullable=False),
)


class InvalidInput(JobfenceError, ValueError):
    """An argument of a workflow task is unusable; `field` names it."""

    def __init__(self, field: str, problem: str) -> None:
        self.field = field
        self.problem = problem
        super().__init__(f"{field}: {problem}")


# -- validation ------------------------------------------------------------------------


def check_id(field: str, value: Any) -> str:
    """A non-empty identifier of at most ID_MAX characters, without surrounding spaces."""
    if not isinstance(value, str):
        raise InvalidInput(field, f"must be a string, got {type(value).__name__}")
    if not value.strip():
        raise InvalidInput(field, "must not be empty")
    if value != value.strip():
        raise InvalidInput(field, f"must not start or end with spaces, got {value!r}")
    if len(value) > ID_MAX:
        raise InvalidInput(field, f"must be at most {ID_MAX} characters, got {len(value)}")
    return value


def check_positive_int(field: str, value: Any, maximum: int) -> int:
    """A positive integer (bool and float refused: amounts are whole cents, stock whole units)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInput(
            field, f"must be a positive integer (whole cents or units), got {value!r}"
        )
    if value <= 0:
        raise InvalidInput(field, f"must be positive, got {value}")
    if value > maximum:
        raise InvalidInput(field, f"must be at most {maximum}, got {value}")
    return value


def check_currency(field: str, value: Any) -> str:
    """A three-letter upper-case ISO 4217 code such as 'EUR'."""
    if not isinstance(value, str) or not _CURRENCY_FORMAT.fullmatch(value):
        raise InvalidInput(field, f"must be a 3-letter upper-case ISO 4217 code, got {value!r}")
    if value not in KNOWN_CURRENCIES:
        raise InvalidInput(field, f"unknown ISO 4217 currency {value!r}")
    return value


# -- schema and seeding ----------------------------------------------------------------


def job_resource(job: JobContext) -> str:
    """The fenced resource of a job: its own lease key, whose grants carry its fences.

    Only tokens from one lease key are comparable; see tasks.stock for why shared rows
    (an account, a sku) are guarded by row locks instead of a fence.
    """
    return f"job:{job.key}"


def now() -> datetime:
    return datetime.now(UTC)


def insert_effect(conn: Connection, insert: Executable, job: JobContext, doing: str) -> None:
    """Insert a job's effect row. A unique-key clash means the same business id was committed
    concurrently under another job key: IdempotencyConflict, "`doing` under another job key"."""
    try:
        conn.execute(insert)
    except IntegrityError as exc:
        raise IdempotencyConflict(
            f"{doing} under another job key", key=job.key, fence=job.fence, cause=exc
        ) from exc


def create_schema(engine: Engine) -> None:
    """Create the ledger tables and jobfence's own (fences, DONE rows). Safe to repeat."""
    for attempt in range(3):
        try:
            SqlEffects(engine).create_schema()
            metadata.create_all(engine)
            return
        except (IntegrityError, ProgrammingError, OperationalError):
            # Another process created the same tables between our check and create.
            if attempt == 2:
                raise


def open_account(
    engine: Engine, account: str, *, currency: str = "EUR", balance_cents: int = 0
) -> bool:
    """Open `account` with a starting balance. False if it exists already (left unchanged)."""
    check_id("account", account)
    check_currency("currency", currency)
    if isinstance(balance_cents, bool) or not isinstance(balance_cents, int) or balance_cents < 0:
        raise InvalidInput(
            "balance_cents", f"must be a non-negative integer, got {balance_cents!r}"
        )
    with engine.begin() as conn:
        row = conn.execute(select(accounts.c.currency).where(accounts.c.account == account)).first()
        if row is not None:
            if row.currency != currency:
                raise InvalidInput(
                    "currency", f"account {account!r} exists in {row.currency}, not {currency}"
                )
            return False
        conn.execute(
            accounts.insert().values(
                account=account, currency=currency, balance_cents=balance_cents, opened_at=now()
            )
        )
    return True


def seed_stock(engine: Engine, levels: dict[str, int]) -> None:
    """Receive `levels` ({sku: units}): new skus start there, existing ones go up by it."""
    for sku, qty in levels.items():
        check_id("sku", sku)
        check_positive_int(f"levels[{sku!r}]", qty, QTY_MAX)
    with engine.begin() as conn:
        for sku in sorted(levels):  # one lock order for concurrent seeders
            qty = levels[sku]
            changed = conn.execute(
                update(stock)
                .where(stock.c.sku == sku)
                .values(
                    received=stock.c.received + qty,
                    quantity=stock.c.quantity + qty,
                    updated_at=now(),
                )
            ).rowcount
            if not changed:
                conn.execute(
                    stock.insert().values(sku=sku, received=qty, quantity=qty, updated_at=now())
                )


# -- reads for demos and tests ---------------------------------------------------------


def balance_of(engine: Engine, account: str) -> int | None:
    with engine.connect() as conn:
        value = conn.execute(
            select(accounts.c.balance_cents).where(accounts.c.account == account)
        ).scalar_one_or_none()
    return None if value is None else int(value)


def stock_of(engine: Engine, sku: str) -> int | None:
    with engine.connect() as conn:
        value = conn.execute(
            select(stock.c.quantity).where(stock.c.sku == sku)
        ).scalar_one_or_none()
    return None if value is None else int(value)


def reserved_total(engine: Engine, sku: str) -> int:
    with engine.connect() as conn:
        value = conn.execute(
            select(func.coalesce(func.sum(reservations.c.qty), 0)).where(reservations.c.sku == sku)
        ).scalar_one()
    return int(value)


def payment_rows(engine: Engine, payment_id: str) -> list[dict[str, Any]]:
    with engine.connect() as conn:
        rows = conn.execute(select(payments).where(payments.c.payment_id == payment_id))
        return [dict(r) for r in rows.mappings()]
