from django.db import migrations, models


class Migration(migrations.Migration):
    initial = True
    dependencies: list = []
    operations = [
        migrations.CreateModel(
            name="Payment",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False)),
                ("payment_id", models.CharField(max_length=64, unique=True)),
                ("amount_cents", models.IntegerField()),
            ],
        ),
    ]
