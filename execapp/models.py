"""execapp's models: API tokens for WebSocket clients and persisted execution profiles."""
from __future__ import annotations

import hashlib
import secrets

from django.db import models
from django.utils import timezone


def hash_token(raw: str) -> str:
    """The stored form of a token: only its SHA-256 is kept."""
    return hashlib.sha256(raw.encode()).hexdigest()


class ApiToken(models.Model):
    """A revocable bearer token for WebSocket clients; only its hash is stored."""

    name = models.CharField(max_length=100, unique=True)
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
    def issue(cls, name: str) -> tuple["ApiToken", str]:
        """Create a token called ``name``; returns the row and the raw token (shown once)."""
        raw = secrets.token_urlsafe(32)
        token = cls.objects.create(name=name, token_hash=hash_token(raw), prefix=raw[:8])
        return token, raw

    @classmethod
    def authenticate(cls, raw: str) -> "ApiToken | None":
        """The live token matching ``raw`` (and its last-used time bumped), or None."""
        if not raw:
            return None
        token = cls.objects.filter(token_hash=hash_token(raw), revoked_at__isnull=True).first()
        if token is not None:
            now = timezone.now()
            cls.objects.filter(pk=token.pk).update(last_used_at=now)
            token.last_used_at = now
        return token

    def revoke(self) -> None:
        """Refuse this token from now on (existing connections keep running until they close)."""
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
