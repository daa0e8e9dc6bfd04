"""ExecProfileRecord.proven_size and .quarantined: what inline was earned on, and a pin to the pool."""
from __future__ import annotations

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("execapp", "0003_apitoken_tenant"),
    ]

    operations = [
        migrations.AddField(
            model_name="execprofilerecord",
            name="proven_size",
            field=models.BigIntegerField(
                default=0, help_text="Largest event size (characters) of a fast, successful run since the last "
                                     "promotion; a demoted handler takes inline only events up to 4x this (at "
                                     "least 1 KiB)."),
        ),
        migrations.AddField(
            model_name="execprofilerecord",
            name="quarantined",
            field=models.TextField(
                blank=True, default="", help_text="Why this matcher is pinned to the pool (it stalled a worker's "
                                                  "loop, or an operator said so); blank: not quarantined."),
        ),
    ]
