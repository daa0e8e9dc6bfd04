"""EventTrace: failed events' traces, kept for EXECAPP['HISTORY_FAILURE_DAYS'] (execapp/history.py)."""
from __future__ import annotations

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("execapp", "0004_profile_containment"),
    ]

    operations = [
        migrations.CreateModel(
            name="EventTrace",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("uid", models.CharField(help_text="The trace's own id (worker tag and sequence).", max_length=64,
                                         unique=True)),
                ("event_id", models.CharField(db_index=True, max_length=64)),
                ("owner", models.CharField(blank=True, db_index=True, default="", max_length=200)),
                ("session", models.CharField(blank=True, default="", max_length=64)),
                ("event_type", models.CharField(blank=True, default="", max_length=64)),
                ("text", models.TextField(blank=True, default="", help_text="A bounded prefix of the event's text.")),
                ("outcome", models.CharField(db_index=True, help_text="error, or the code that refused the event.",
                                             max_length=40)),
                ("codes", models.CharField(blank=True, default="", help_text="Failure codes, comma-separated.",
                                           max_length=400)),
                ("matchers", models.TextField(blank=True, default="")),
                ("plugins", models.TextField(blank=True, default="")),
                ("worker", models.CharField(blank=True, default="", max_length=200)),
                ("created_at", models.DateTimeField(db_index=True, help_text="When the event was accepted.")),
                ("duration_seconds", models.FloatField(blank=True, null=True)),
                ("trace", models.JSONField(default=dict)),
            ],
            options={"verbose_name": "event", "verbose_name_plural": "events", "ordering": ["-created_at"]},
        ),
    ]
