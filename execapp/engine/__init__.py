"""The adaptive execution engine: plain Python, no Django import (docs/architecture.md, "Design rules")."""
from .engine import Engine
from .errors import (
    BadEvent,
    ConfigError,
    ExecAppError,
    HandlerError,
    HandlerTimeout,
    NotStarted,
    Overloaded,
    PoolClosed,
)
from .event import Completion, Context, Event, EventRun, Failure, Reply
from .matcher import Matcher, MatcherKind, parse_command
from .pool import ExecPool
from .profile import ExecClass, ExecProfile, ProfileState

__all__ = [
    "BadEvent", "Completion", "ConfigError", "Context", "Engine", "Event", "EventRun", "ExecAppError", "NotStarted",
    "ExecClass", "ExecPool", "ExecProfile", "Failure", "HandlerError", "HandlerTimeout", "Matcher",
    "MatcherKind", "Overloaded", "PoolClosed", "ProfileState", "Reply", "parse_command",
]
