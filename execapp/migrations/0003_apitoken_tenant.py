"""ApiToken.tenant: the owner of a token's sessions. Existing tokens become their own owners."""
from __future__ import annotations

from typing import Any

from django.db import migrations, models


def each_token_owns_itself(apps: Any, schema_editor: Any) -> None:
    """Before this migration every token could read every session; from now on each existing token is
    its own tenant (the safe choice). Give tokens that must share sessions one tenant in the admin."""
    ApiToken = apps.get_model("execapp", "ApiToken")
    for token in ApiToken.objects.filter(tenant=""):
        ApiToken.objects.filter(pk=token.pk).update(tenant=token.name)


class Migration(migrations.Migration):

    dependencies = [
        ("execapp", "0002_observability"),
    ]

    operations = [
        migrations.AddField(
            model_name="apitoken",
            name="tenant",
            field=models.CharField(
                blank=True, max_length=100,
                help_text="The owner of this token's sessions: tokens of one tenant share session names, other "
                          "tenants never see them. Blank: the token's name (the token is its own owner)."),
        ),
        migrations.RunPython(each_token_owns_itself, migrations.RunPython.noop),
    ]
