"""GET /healthz: the readiness probe of one worker process, and the dependency checks it runs.

503 while the worker starts or drains, and while the database (or, with ``REDIS_URL``, the
channel layer's Redis) does not answer; 200 again by itself once it does. A dependency check
is one new connection and ``SELECT 1`` (a Redis ``PING``) on its own thread, at most one in
flight per dependency, waited on for ``HEALTH_CHECK_TIMEOUT_SECONDS`` and its answer reused for
``HEALTH_CHECK_CACHE_SECONDS``: probes, however many, cost the database at most one connection
per worker process per interval. See docs/operations.md ("Health").
"""
from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any, Callable
from urllib.parse import urlparse

from django.db import DEFAULT_DB_ALIAS
from django.http import HttpRequest, JsonResponse
from django.views.decorators.http import require_GET

from . import conf
from . import worker as worker_module

log = logging.getLogger("execapp.health")


class DependencyProbe:
    """One dependency's reachability, checked on a daemon thread, the answer reused for a while."""

    def __init__(self, name: str, label: str, check: Callable[[float], None]) -> None:
        self.name = name  # key in the /healthz answer: "database", "channel_layer"
        self.label = label  # for the log: where it is (never shown to HTTP clients)
        self._check = check
        # Probes arrive on many request threads at once: the lock guards the answer and the one
        # check in flight; nobody holds it while a check runs or while waiting for one.
        self._lock = threading.Lock()
        self._answer: str | None = None  # None: reachable; else a short reason
        self._answered_at = -math.inf
        self._running: threading.Event | None = None  # set when the check in flight is over
        self._failing = False

    def refresh(self, timeout: float, max_age: float) -> threading.Event | None:
        """Start a check unless the answer is fresh or one is in flight; the event that ends the
        check in flight, or None when the answer is fresh."""
        with self._lock:
            if time.monotonic() - self._answered_at < max_age:
                return None
            if self._running is None:
                # A daemon thread, not the caller's: a check that hangs (a blackholed host) costs
                # one parked thread per dependency, never a probe's answer or the process's exit.
                self._running = threading.Event()
                threading.Thread(target=self._run, args=(timeout, self._running),
                                 name=f"execapp-health-{self.name}", daemon=True).start()
            return self._running

    def failure(self, timeout: float, max_age: float, wait: float | None = None) -> str | None:
        """None while the dependency answers, else why not; blocks at most ``wait`` (default
        ``timeout``) seconds."""
        done = self.refresh(timeout, max_age)
        if done is None:
            with self._lock:
                return self._answer
        if done.wait(timeout if wait is None else wait):
            with self._lock:
                return self._answer
        with self._lock:
            if self._running is done:  # still in flight: say so until it ends (no second check meanwhile)
                self._settle(f"no answer within {timeout:g} s", f"no answer within {timeout:g} s")
            return self._answer

    def _run(self, timeout: float, done: threading.Event) -> None:
        try:
            self._check(timeout)
            answer, detail = None, ""
        except Exception as exc:  # any failure to answer is the answer
            answer, detail = f"cannot connect ({type(exc).__name__})", f"{type(exc).__name__}: {exc}".strip()
        with self._lock:
            self._running = None
            self._settle(answer, detail)
        done.set()

    def _settle(self, answer: str | None, detail: str) -> None:
        """Record an answer (under the lock); log only the changes: down once, back once."""
        self._answer, self._answered_at = answer, time.monotonic()
        if answer is not None and not self._failing:
            log.warning("healthz: %s (%s) is unreachable, /healthz answers 503: %s", self.name, self.label, detail)
        elif answer is None and self._failing:
            log.warning("healthz: %s (%s) answers again", self.name, self.label)
        self._failing = answer is not None


def check_database(settings_dict: dict[str, Any], timeout: float, alias: str = DEFAULT_DB_ALIAS) -> None:
    """Open a new connection to the database of ``settings_dict`` and run ``SELECT 1``; raises if it cannot.

    A private connection, not the thread's ``connections[alias]``: it gets a short connect
    timeout, bypasses a configured connection pool, and is closed at once.
    """
    from django.db.utils import load_backend

    options = {k: v for k, v in (settings_dict.get("OPTIONS") or {}).items() if k != "pool"}
    backend = load_backend(settings_dict["ENGINE"])
    if backend.DatabaseWrapper.vendor in ("postgresql", "mysql"):
        # Whole seconds; libpq takes 2 as its least (the probe's own wait is still `timeout`).
        options["connect_timeout"] = max(1, math.ceil(timeout))
    wrapper = backend.DatabaseWrapper({**settings_dict, "OPTIONS": options}, alias)
    raw = wrapper.get_new_connection(wrapper.get_connection_params())
    try:
        cursor = raw.cursor()
        cursor.execute("SELECT 1" + wrapper.features.bare_select_suffix)
        cursor.fetchone()
        cursor.close()
    finally:
        raw.close()


def redis_checker(url: str) -> Callable[[float], None]:
    """A check that writes a key of ours to the Redis at ``url`` (one client kept per probe, no
    retries). A write, not a PING: a Redis at its maxmemory (OutOfMemoryError) or a replica left
    read-only after a failover answers PING while every session frame, resend record and drain
    fails (measured: /healthz said ok through a 21 s OOM that stopped every tenant's sessions)."""
    client: Any = None

    def check(timeout: float) -> None:
        nonlocal client
        if client is None:  # only ever used by the probe's one check in flight
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry

            client = redis.Redis.from_url(url, socket_connect_timeout=timeout, socket_timeout=timeout,
                                          retry=Retry(NoBackoff(), 0))
        client.set(conf.redis_key("execapp:health"), b"1", ex=60)

    return check


def _where(url: str) -> str:
    """host:port of a service URL, without its credentials (for the log)."""
    parsed = urlparse(url)
    return f"{parsed.hostname or parsed.path}:{parsed.port}" if parsed.port else (parsed.hostname or parsed.path)


_probes: dict[tuple, DependencyProbe] = {}
_probes_lock = threading.Lock()


def _probe(key: tuple, factory: Callable[[], DependencyProbe]) -> DependencyProbe:
    with _probes_lock:
        probe = _probes.get(key)
        if probe is None:
            probe = _probes[key] = factory()
        return probe


def dependency_probes() -> list[DependencyProbe]:
    """The probes of this process's configuration: the default database, and Redis when REDIS_URL is set."""
    from django.db import connections

    db = connections.settings[DEFAULT_DB_ALIAS]
    key = ("database", DEFAULT_DB_ALIAS, db["ENGINE"], db.get("HOST"), db.get("PORT"), str(db.get("NAME")))
    where = f"{db['ENGINE'].rpartition('.')[2]} {db.get('HOST') or ''}:{db.get('PORT') or ''}/{db.get('NAME')}"
    probes = [_probe(key, lambda: DependencyProbe(
        "database", where, lambda timeout: check_database(db, timeout)))]
    url = conf.redis_url()
    if url:
        probes.append(_probe(("channel_layer", url), lambda: DependencyProbe(
            "channel_layer", f"Redis at {_where(url)}", redis_checker(url))))
    return probes


def dependency_failures() -> dict[str, str]:
    """{dependency: reason} for every dependency that does not answer now (empty when all do)."""
    timeout, max_age = conf.get("HEALTH_CHECK_TIMEOUT_SECONDS"), conf.get("HEALTH_CHECK_CACHE_SECONDS")
    probes = dependency_probes()
    deadline = time.monotonic() + timeout
    for probe in probes:  # all checks run at once: two dead services cost one timeout, not two
        probe.refresh(timeout, max_age)
    failures = {}
    for probe in probes:
        reason = probe.failure(timeout, max_age, wait=max(0.0, deadline - time.monotonic()))
        if reason is not None:
            failures[probe.name] = reason
    return failures


@require_GET
def healthz(request: HttpRequest) -> JsonResponse:
    """200 while this worker takes events and its database (and Redis) answer; 503 while it starts,
    drains or a dependency is unreachable: a load balancer moves clients.

    A sync view on purpose: the first call may build the Worker, whose services can touch the
    database, which Django refuses on the event loop's thread.
    """
    try:
        worker = worker_module.get_worker()
    except Exception as exc:  # e.g. a service that needs the database at start: still an answer
        failures = dependency_failures()
        return JsonResponse({"status": "unavailable" if failures else "starting", "worker": None, "draining": False,
                             "events_in_flight": 0, "error": type(exc).__name__,
                             **({"unavailable": failures} if failures else {})}, status=503)
    draining = worker.draining
    body: dict[str, Any] = {"status": "draining" if draining else "ok" if worker.ready.is_set() else "starting",
                            "worker": worker.id, "draining": draining, "events_in_flight": worker.events_in_flight}
    if not draining:  # a drain's answer is immediate: it never waits for a dependency check
        failures = dependency_failures()
        if failures:
            body["status"], body["unavailable"] = "unavailable", failures
    return JsonResponse(body, status=200 if body["status"] == "ok" else 503)
