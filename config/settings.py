"""Django settings for the execapp project.

Everything that differs between the embedded default (one process, SQLite, in-memory channel
layer) and production (many ASGI workers, PostgreSQL, Redis) comes from the environment:
``DATABASE_URL``, ``REDIS_URL``, ``SECRET_KEY``, ``DEBUG``, ``ALLOWED_HOSTS``, ``LOG_FORMAT``, the HTTPS
settings (``HTTPS``, ``SECURE_*``, ``*_COOKIE_SECURE``, ``CSRF_TRUSTED_ORIGINS``); and any
``EXECAPP`` setting as ``EXECAPP_<NAME>`` (execapp/conf.py).
"""
import os
from pathlib import Path

import dj_database_url

BASE_DIR = Path(__file__).resolve().parent.parent

# The default is public: refused (execapp.E130, execapp/checks.py) once ALLOWED_HOSTS has a non-local name.
SECRET_KEY = os.environ.get("SECRET_KEY", "dev-only-insecure-key-change-me-in-production")
DEBUG = os.environ.get("DEBUG", "0") == "1"
ALLOWED_HOSTS = [h for h in os.environ.get("ALLOWED_HOSTS", "127.0.0.1,localhost,[::1],testserver").split(",") if h]
CSRF_TRUSTED_ORIGINS = [o.strip() for o in os.environ.get("CSRF_TRUSTED_ORIGINS", "").split(",") if o.strip()]


def _env_bool(name: str, default: bool) -> bool:
    """The environment variable ``name`` read as a yes/no; a value that is neither stops the start."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={raw!r}: use 1 or 0 (true/false, yes/no, on/off)")


def _env_int(name: str, default: int) -> int:
    """The environment variable ``name`` read as a whole number >= 0; another value stops the start."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{name}={raw!r}: use a whole number of seconds >= 0")
    return value


# Behind TLS (docs/operations.md, "Behind TLS"). HTTPS=1 turns on the redirect to https:// and the
# secure-only session and CSRF cookies at once; each variable below overrides it. HSTS stays off
# unless SECURE_HSTS_SECONDS is set: a browser that saw it refuses plain HTTP for that long.
HTTPS = _env_bool("HTTPS", False)
SECURE_SSL_REDIRECT = _env_bool("SECURE_SSL_REDIRECT", HTTPS)
# The load balancer's probe and Prometheus' scrape come over plain HTTP from inside the network:
# a 301 to https:// would fail the probe of every worker at once.
SECURE_REDIRECT_EXEMPT = [r"^healthz$", r"^metrics$"]
SESSION_COOKIE_SECURE = _env_bool("SESSION_COOKIE_SECURE", HTTPS)
CSRF_COOKIE_SECURE = _env_bool("CSRF_COOKIE_SECURE", HTTPS)
SECURE_HSTS_SECONDS = _env_int("SECURE_HSTS_SECONDS", 0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = _env_bool("SECURE_HSTS_INCLUDE_SUBDOMAINS", False)
SECURE_HSTS_PRELOAD = _env_bool("SECURE_HSTS_PRELOAD", False)
# "HTTP_X_FORWARDED_PROTO,https": the header (as Django names it) and the value a TLS-terminating
# proxy sets. Only behind a proxy that always sets (or strips) it: a client could send it itself.
# The WebSocket Origin check honours it too (execapp.auth.origin_allowed).
_proxy_ssl_header = os.environ.get("SECURE_PROXY_SSL_HEADER", "").strip()
if _proxy_ssl_header:
    _header_name, _, _header_value = (part.strip() for part in _proxy_ssl_header.partition(","))
    if not _header_name.startswith("HTTP_") or not _header_value:
        raise ValueError(f"SECURE_PROXY_SSL_HEADER={_proxy_ssl_header!r}: use the header as Django names it and "
                         "the value meaning https, e.g. HTTP_X_FORWARDED_PROTO,https")
    SECURE_PROXY_SSL_HEADER = (_header_name, _header_value)

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "channels",
    "django_prometheus",
    "execapp",
    "plugins",
]

MIDDLEWARE = [
    # /healthz (and /metrics with a token) by IP address, as Kubernetes' probes and Prometheus' pod
    # discovery ask, whatever ALLOWED_HOSTS lists (execapp/probe_hosts.py).
    "execapp.probe_hosts.ProbeHostMiddleware",
    "django_prometheus.middleware.PrometheusBeforeMiddleware",
    # Every request's database calls within EXECAPP['REQUEST_DB_DEADLINE_SECONDS'] on a PostgreSQL
    # that does not answer (execapp/request_db_deadline.py); before the session and user lookups.
    "execapp.request_db_deadline.RequestDatabaseDeadlineMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    # A client that may change nothing sends at most EXECAPP['READ_ONLY_BODY_BYTES'] of body: Django's form
    # parser (run by the CSRF check above, in process_view) is not given more (execapp/read_only_body.py).
    "execapp.read_only_body.ReadOnlyBodyLimit",
    # A browser that signs in gets a device cookie: its own sign-in lane (execapp/login_device.py).
    "execapp.login_device.LoginDeviceMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    # Scripts only from this site's files, no framing (execapp/security_headers.py).
    "execapp.security_headers.ContentSecurityPolicyMiddleware",
    "django_prometheus.middleware.PrometheusAfterMiddleware",
]

ROOT_URLCONF = "config.urls"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

WSGI_APPLICATION = None
ASGI_APPLICATION = "config.asgi.application"

DATABASES = {
    "default": dj_database_url.config(
        env="DATABASE_URL",
        default=f"sqlite:///{BASE_DIR / 'db.sqlite3'}",
        conn_max_age=int(os.environ.get("CONN_MAX_AGE", "60")),
        # A connection kept across requests (CONN_MAX_AGE) is checked (SELECT 1) before its first
        # use in each: without it, after a PostgreSQL restart, failover or pg_terminate_backend every
        # kept connection failed its next use (a handshake refused 1013 'database unavailable', a
        # batch of failure traces or a KV call lost) although the database answered again.
        conn_health_checks=True,
    )
}
if DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql":
    # libpq waits for a new connection without limit by default: a PostgreSQL host that accepts but
    # never answers (a stall, a pgbouncer at its limit) held each thread opening one for as long as it
    # lasted. `?connect_timeout=N` in DATABASE_URL overrides. Statements: execapp/db_cutoff.py.
    DATABASES["default"].setdefault("OPTIONS", {}).setdefault("connect_timeout", 5)
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # The embedded default: several threads (pool workers, flusher) and commands (loadplugins
    # while the server runs) write to one file. IMMEDIATE: a transaction takes the write lock when
    # it begins, and waits up to `timeout` for it; a deferred one that reads and then writes failed
    # at once with "database is locked" when another had written meanwhile (seen in CI).
    DATABASES["default"].setdefault("OPTIONS", {}).update({"timeout": 20, "transaction_mode": "IMMEDIATE"})
    DATABASES["default"]["CONN_MAX_AGE"] = 0

REDIS_URL = os.environ.get("REDIS_URL", "")
if REDIS_URL:
    from redis.asyncio.retry import Retry as _Retry
    from redis.backoff import NoBackoff as _NoBackoff
    from redis.exceptions import ConnectionError as _RedisConnectionError

    CHANNEL_LAYERS = {
        "default": {
            # channels_redis' layer whose per-channel buffers end with the channel (execapp/redis_layer.py).
            "BACKEND": "execapp.redis_layer.RedisChannelLayer",
            # redis-py 8 defaults socket_timeout to 5 s, the same as channels_redis' server-side
            # blocking pop (brpop_timeout = 5): every idle consumer's receive then raises
            # TimeoutError and its WebSocket drops every ~5 s. Read timeout above the pop's.
            # Recovery from a Redis restart is not left to these timeouts: each worker's
            # LayerWatch checks the layer every EXECAPP['LAYER_CHECK_SECONDS'] (1 s) and re-adds its
            # memberships once Redis answers (docs/operations.md, "When Redis goes away"). A pooled
            # connection idle for 2 s is PINGed before reuse (health_check_interval) and a command
            # that finds its connection dead is retried once on a new one (retry): after a restart,
            # no group_send fails on a socket of the old server. Connecting gives up after 2 s.
            "CONFIG": {"hosts": [{"address": REDIS_URL, "socket_timeout": 15, "socket_connect_timeout": 2,
                                  "health_check_interval": 2,
                                  "retry": _Retry(_NoBackoff(), 1, supported_errors=(_RedisConnectionError,))}],
                       "capacity": 1500, "expiry": 30,
                       # Namespaces channels, groups and the control registry: two deployments
                       # sharing one Redis must differ in REDIS_PREFIX (or in the database).
                       "prefix": os.environ.get("REDIS_PREFIX", "asgi")},
        }
    }
else:
    CHANNEL_LAYERS = {"default": {"BACKEND": "execapp.channel_layer.InMemoryChannelLayer"}}

# Error reports (the DEBUG=1 page, mails) hide passwords in URLs too: REDIS_URL, the channel layer's hosts.
DEFAULT_EXCEPTION_REPORTER_FILTER = "execapp.safe_settings.SafeSettingsFilter"

# Where a sign-in lands when its ?next= is refused (another site: //evil.example, https://...):
# the admin, not Django's default /accounts/profile/, a 404 here.
LOGIN_REDIRECT_URL = "admin:index"

# A form's data, files aside, that Django reads (default 2.5 MiB): the admin's plugin form carries a
# plugin's source as text, which may be 4 MiB (plugins.runtimes.registry.MAX_CODE_BYTES); at 2.5 MiB a
# source pasted between the two was a bare "Bad Request (400)" (plugins.W001 checks it). Bodies stay
# capped by EXECAPP['MAX_REQUEST_BODY_BYTES'] (8 MiB) before Django reads them.
DATA_UPLOAD_MAX_MEMORY_SIZE = 5 * 1_048_576

# Django's ModelBackend with at most EXECAPP['MAX_PASSWORD_CHECKS'] password checks at once per
# worker: each is ~0.5 s of CPU, and anyone may ask for one at the admin's login.
AUTHENTICATION_BACKENDS = ["execapp.login_limit.LimitedModelBackend"]

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = BASE_DIR / "staticfiles"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# LOG_FORMAT=json: one JSON object per line (execapp/logjson.py) for log shippers; plain otherwise.
LOG_FORMAT = os.environ.get("LOG_FORMAT", "plain").strip().lower()
if LOG_FORMAT not in ("plain", "json"):
    raise ValueError(f"LOG_FORMAT={LOG_FORMAT!r}: use plain (the default) or json")
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    # plain: a client's or a plugin's text in a message cannot start a line of its own (execapp/logtext.py).
    "formatters": {"plain": {"()": "execapp.logtext.PlainFormatter",
                             "fmt": "%(asctime)s %(levelname)s %(name)s %(message)s"},
                   "json": {"()": "execapp.logjson.JsonFormatter"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": LOG_FORMAT}},
    "loggers": {
        "execapp": {"handlers": ["console"], "level": os.environ.get("EXECAPP_LOG_LEVEL", "INFO")},
        "plugins": {"handlers": ["console"], "level": os.environ.get("EXECAPP_LOG_LEVEL", "INFO")},
        # A view's unhandled exception (a 500), with its traceback. Django's own handler for it
        # writes only with DEBUG=1 (and mails ADMINS, none here): a server error left no line at all.
        # ERROR only: its 4xx warnings are in uvicorn's access log already.
        "django.request": {"handlers": ["console"], "level": "ERROR", "propagate": False},
    },
}

# The app's own settings: one namespaced dict; defaults live in execapp/conf.py.
EXECAPP: dict = {}
