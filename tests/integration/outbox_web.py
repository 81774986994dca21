"""One web-like process of the publish-on-commit storm (tests/integration/test_outbox_storm.py).

``python -m tests.integration.outbox_web MODE SEED COUNT DIE`` prints "ready", waits for a
line on stdin ("go"), then commits or rolls back COUNT
orders at random (SEED), each publishing its job on commit: MODE ``outbox`` through
`apply_async_on_commit(session=...)`, ``naive`` through an after-commit `apply_async` (what
Celery's `delay_on_commit` does). DIE (``none``, ``before``, ``after``): this process SIGKILLs
itself at its first committed order, just before its publish or just after it (before the
row is marked sent). The environment is the fleet's (BROKER_URL may point at a proxy).
"""

from __future__ import annotations

import logging
import os
import random
import signal
import sys
from typing import Any

from sqlalchemy import event
from sqlalchemy.orm import Session

import jobfence.tasks.outbox as outbox_module
from tests.integration.apps import outbox_app


def main(mode: str, seed: int, count: int, die: str) -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    app = outbox_app.create_app(os.environ)
    rng = random.Random(seed)
    eng = outbox_app.engine(app)
    with eng.connect():  # connected: the test may cut the broker now
        pass
    print("ready", flush=True)
    sys.stdin.readline()  # "go": the test has cut the broker (or lets it be)
    committed_once = False

    def dies(moment: str) -> None:
        if die == moment:
            os.kill(os.getpid(), signal.SIGKILL)

    real_publish = outbox_module.publish_entry

    def publish(app_: Any, entry: Any) -> None:
        dies("before")
        real_publish(app_, entry)
        dies("after")

    outbox_module.publish_entry = publish  # type: ignore[assignment]
    for i in range(count):
        order = f"{mode}-{seed}-{i}"
        commit = rng.random() < 0.75 or (die != "none" and not committed_once)
        with Session(eng) as session:
            session.execute(outbox_app.orders.insert().values(id=order, mode=mode))
            if mode == "outbox":
                app.tasks[outbox_app.FULFIL].apply_async_on_commit((order,), session=session)
            else:
                def naive_publish(_s: Session, order: str = order) -> None:
                    dies("before")
                    try:
                        app.tasks[outbox_app.NAIVE_FULFIL].apply_async((order,))
                    except Exception as exc:  # as Django's robust on_commit: logged, lost
                        print(f"publish failed: {type(exc).__name__}", file=sys.stderr)
                    dies("after")

                event.listen(session, "after_commit", naive_publish, once=True)
            if commit:
                session.commit()
                committed_once = True
            else:
                session.rollback()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
