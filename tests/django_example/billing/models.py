from django.db import models


class Payment(models.Model):
    payment_id = models.CharField(max_length=64, unique=True)
    amount_cents = models.IntegerField()
