"""Plugin.loaded_fingerprint: what `loadplugins` last wrote, so it never overwrites an edited plugin."""
from __future__ import annotations

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("plugins", "0003_runtime_registry"),
    ]

    operations = [
        migrations.AddField(
            model_name="plugin",
            name="loaded_fingerprint",
            field=models.CharField(blank=True, default="", editable=False, max_length=64),
        ),
    ]
