"""execapp's models: API tokens for WebSocket clients and persisted execution profiles."""
from __future__ import annotations

import datetime as dt
import hashlib
import secrets
from typing import Any

from django.db import models
from django.utils import timezone


def hash_token(raw: str) -> str:
    """The stored form of a token: only its SHA-256 is kept."""
    return hashlib.sha256(raw.encode()).hexdigest()


#: How precisely a token's ``last_used_at`` is kept (one database write per token per this long).
LAST_USED_RESOLUTION = dt.timedelta(minutes=1)


class ApiToken(models.Model):
    """A revocable bearer token for WebSocket clients; only its hash is stored."""

    name = models.CharField(max_length=100, unique=True)
    tenant = models.CharField(
        max_length=100, blank=True,
        help_text="The owner of this token's sessions: tokens of one tenant share session names, other tenants "
                  "never see them. Blank: the token's name (the token is its own owner).")
    token_hash = models.CharField(max_length=64, unique=True, editable=False)
    prefix = models.CharField(max_length=8, editable=False, help_text="First characters, to tell tokens apart.")
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        verbose_name = "API token"
        ordering = ["name"]

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}…{' revoked' if self.revoked_at else ''})"

    @classmethod
    def tenant_members(cls, tenant: str, exclude_pk: Any = None) -> list[str]:
        """Names of the tokens (other than ``exclude_pk``) whose tenant is ``tenant``, a few at most."""
        return list(cls.objects.filter(tenant=tenant).exclude(pk=exclude_pk).values_list("name", flat=True)[:3])

    def joins_by_default(self) -> str | None:
        """Why this token with a blank tenant is not its own tenant, or None.

        A blank tenant becomes the token's name; if that name is already other tokens' tenant,
        the token would silently join them (read and write their sessions), where a new token
        is meant to be its own owner (docs/protocol.md, "Owners")."""
        if self.tenant.strip():
            return None
        members = self.tenant_members(self.name.strip(), self.pk)
        if not members:
            return None
        name = self.name.strip()
        return (f"token {name!r} would join tenant {name!r}, the tenant of {', '.join(map(repr, members))}, and "
                "share its sessions (a blank tenant is the token's name); to mean that, set the tenant to it "
                "explicitly, otherwise pick another name")

    def clean(self) -> None:
        """Model validation (the admin's forms): a blank tenant must not silently join another tenant."""
        from django.core.exceptions import ValidationError

        why = self.joins_by_default()
        if why is not None:
            raise ValidationError({"tenant": why}, code="tenant_taken")

    def save(self, *args: Any, **kwargs: Any) -> None:
        """Save; a blank tenant becomes the token's name (the admin's add form may leave it blank)."""
        self.tenant = self.tenant.strip() or self.name
        super().save(*args, **kwargs)

    @property
    def owner(self) -> str:
        """The owner key of this token's sessions (see execapp.protocol.group_name)."""
        return self.owner_of(self.tenant, self.name)

    @staticmethod
    def owner_of(tenant: str, name: str) -> str:
        """The owner key of a token with this ``tenant`` and ``name`` (see ``owner``)."""
        return f"tenant:{tenant or name}"

    @classmethod
    def issue(cls, name: str, tenant: str = "") -> tuple["ApiToken", str]:
        """Create a token called ``name`` owned by ``tenant`` (blank: its own name); returns the row and
        the raw token (shown once)."""
        raw = secrets.token_urlsafe(32)
        token = cls.objects.create(name=name, tenant=tenant, token_hash=hash_token(raw), prefix=raw[:8])
        return token, raw

    @classmethod
    def authenticate(cls, raw: str) -> "ApiToken | None":
        """The live token matching ``raw`` (its last-used time bumped, to the minute), or None."""
        if not raw:
            return None
        token = cls.objects.filter(token_hash=hash_token(raw), revoked_at__isnull=True).first()
        if token is not None:
            now = timezone.now()
            # At most one write a minute per token: a client reconnecting as fast as it can (or a
            # reconnect storm of thousands) made one UPDATE per handshake.
            if token.last_used_at is None or now - token.last_used_at >= LAST_USED_RESOLUTION:
                cls.objects.filter(pk=token.pk).update(last_used_at=now)
                token.last_used_at = now
        return token

    def revoke(self) -> None:
        """Refuse this token from now on (its open connections are closed within
        EXECAPP['AUTH_RECHECK_SECONDS']: execapp/auth_watch.py)."""
        self.revoked_at = timezone.now()
        self.save(update_fields=["revoked_at"])


class ExecProfileRecord(models.Model):
    """The persisted execution profile of one matcher, merged from every worker's flushes."""

    STATES = [("learning", "learning"), ("promoted", "promoted (pool)"), ("demoted", "demoted (inline)")]

    matcher = models.CharField(max_length=200, unique=True)
    plugin = models.CharField(max_length=100, blank=True, default="")
    state = models.CharField(max_length=10, choices=STATES, default="learning")
    window = models.JSONField(default=list, help_text="Recent durations in seconds, oldest first.")
    p50_seconds = models.FloatField(null=True, blank=True)
    p99_seconds = models.FloatField(null=True, blank=True)
    runs = models.BigIntegerField(default=0)
    errors = models.BigIntegerField(default=0)
    timeouts = models.BigIntegerField(default=0)
    promotions = models.BigIntegerField(default=0)
    demotions = models.BigIntegerField(default=0)
    promoted_at = models.DateTimeField(null=True, blank=True)
    demoted_at = models.DateTimeField(null=True, blank=True)
    last_error = models.TextField(blank=True, default="")
    updated_at = models.DateTimeField(default=timezone.now)
    proven_size = models.BigIntegerField(
        default=0, help_text="Largest event size (characters) of a fast, successful run since the last promotion; "
                             "a demoted handler takes inline only events up to 4x this (at least 1 KiB).")
    quarantined = models.TextField(
        blank=True, default="", help_text="Why this matcher is pinned to the pool (it stalled a worker's loop, or "
                                          "an operator said so); blank: not quarantined.")

    class Meta:
        verbose_name = "execution profile"
        ordering = ["matcher"]

    def __str__(self) -> str:
        return f"{self.matcher} [{self.state}]"


class Dashboard(ExecProfileRecord):
    """The admin's entry for the live pool dashboard (a proxy: no table; see execapp/dashboard.py)."""

    class Meta:
        proxy = True
        verbose_name = "live pool dashboard"
        verbose_name_plural = "live pool dashboard"


class EventTrace(models.Model):
    """A failed event's trace, kept in the database for EXECAPP['HISTORY_FAILURE_DAYS'] (execapp/history.py).

    Every event's trace is first kept in the bounded recent store (Redis or this process); the
    failures are also written here, so they outlive that store. The admin's *Events* page reads both.
    """

    uid = models.CharField(max_length=64, unique=True, help_text="The trace's own id (worker tag and sequence).")
    event_id = models.CharField(max_length=64, db_index=True)
    owner = models.CharField(max_length=200, blank=True, default="", db_index=True)
    session = models.CharField(max_length=64, blank=True, default="")
    event_type = models.CharField(max_length=64, blank=True, default="")
    text = models.TextField(blank=True, default="", help_text="A bounded prefix of the event's text.")
    outcome = models.CharField(max_length=40, db_index=True, help_text="error, or the code that refused the event.")
    codes = models.CharField(max_length=400, blank=True, default="", help_text="Failure codes, comma-separated.")
    # ",a,b,": a filter for one name is a `contains` of ",name," (names may hold any character but ",").
    matchers = models.TextField(blank=True, default="")
    plugins = models.TextField(blank=True, default="")
    worker = models.CharField(max_length=200, blank=True, default="")
    created_at = models.DateTimeField(db_index=True, help_text="When the event was accepted.")
    duration_seconds = models.FloatField(null=True, blank=True)
    trace = models.JSONField(default=dict)

    class Meta:
        verbose_name = "event"
        verbose_name_plural = "events"
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.event_id} [{self.outcome}]"
