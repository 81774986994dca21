"""The billing app's tasks: one payment charged once, whatever the duplicates."""

from billing.models import Payment
from jobfence import singleton_task
from jobfence.tasks.django import django_effects


@singleton_task(bind=True, key=["payment_id"])
def charge(self, payment_id, amount_cents):
    with django_effects.transaction(self.job, f"payment:{payment_id}") as tx:
        if tx.done:  # took effect before: the stored result
            return tx.result
        Payment.objects.create(payment_id=payment_id, amount_cents=amount_cents)
        tx.result = {"charged": amount_cents}
    return tx.result
