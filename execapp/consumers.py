"""The Channels consumer of /ws/events/: a thin adapter from Channels to ``execapp.connection``."""
from __future__ import annotations

import asyncio
import logging
import weakref
from typing import Any, Awaitable, Callable, Coroutine
from urllib.parse import parse_qs

from asgiref.sync import sync_to_async
from channels.exceptions import StopConsumer
from channels.generic.websocket import AsyncWebsocketConsumer
from channels.layers import get_channel_layer
from django.db import Error as DatabaseError

from . import auth_watch, conf, metrics
from . import worker as worker_module
from .auth import CLOSE_INTERNAL_ERROR, CLOSE_TRY_AGAIN_LATER, close_reason, database_unavailable
from .codes import TOO_MANY_CONNECTIONS
from .connection import Connection
from .engine.ratelog import RateLimitedLog
from .layer_watch import LayerWatch, watch_for
from .protocol import (
    MAX_SESSION_CHARS,
    MAX_SESSIONS_PER_CONNECTION,
    Limits,
    ProtocolError,
    check_session,
    owner_digest,
    session_of,
)
from .redis_layer import ChannelReleased
from .ws_flow import CONNECTION_LOST

log = logging.getLogger("execapp.consumers")
_rare = RateLimitedLog(log, 60.0)

#: How long a disconnect waits, per attempt, for the channel-layer reader to stop.
_READER_STOP_SECONDS = 0.5
#: A reader whose receive keeps failing although the layer answers waits this long, doubling.
_READER_BACKOFF_SECONDS = (0.05, 1.0)
#: Close code of a handshake over the owner's connection quota (RFC 6455: policy violation).
CLOSE_POLICY_VIOLATION = 1008
#: Problems with the URL's ?session= sent one error frame each; the rest in one more.
_URL_PROBLEMS_SHOWN = 3
#: owner -> its session publishes, joins and leaves in flight on this worker (held by its connections while they live).
_publish_slots: "weakref.WeakValueDictionary[str, asyncio.Semaphore]" = weakref.WeakValueDictionary()


def publish_slots(owner: str) -> asyncio.Semaphore:
    """The channel-layer calls (group sends, joins, leaves) ``owner``'s connections may have in
    flight at once on this worker (EXECAPP['SESSION_PUBLISHES_PER_OWNER']), shared by them."""
    slots = _publish_slots.get(owner)
    if slots is None:
        slots = _publish_slots[owner] = asyncio.Semaphore(int(conf.get("SESSION_PUBLISHES_PER_OWNER")))
    return slots


async def aget_worker() -> worker_module.Worker:
    """The process's Worker; the first call builds it off the loop (its services may touch the DB)."""
    worker = worker_module.current_worker()
    if worker is not None:
        return worker
    return await sync_to_async(worker_module.get_worker, thread_sensitive=False)()


def _send_now_of(send: Any) -> Callable[[str], bool] | None:
    """The server protocol's own coroutine-free write of a text frame when ``send`` (the ASGI send) is
    that protocol's ``send`` (execapp.ws_flow under execapp.serve); None under any other server or
    wrapper (daphne, a test's communicator, a middleware's send): every frame then goes through ``send``."""
    owner = getattr(send, "__self__", None)
    send_now = getattr(owner, "send_text_now", None)
    return send_now if callable(send_now) and getattr(send, "__name__", "") == "send" else None


class EventConsumer(AsyncWebsocketConsumer):
    """One WebSocket client of /ws/events/: frames in, the engine's outcomes out.

    Two departures from Channels' generic consumer, both for the frame path:

    - Channels runs ``close_old_connections()`` in its one shared sync thread before every
      message (a thread hop per frame, serialized across every connection of the process).
      Nothing here touches the database (the handshake's token and session lookups clean up
      after themselves), so messages are routed directly.
    - The channel layer is only used by session groups, so a connection gets its layer
      channel, and the task reading it, when it first joins a session. Connections without
      sessions never touch the layer; and a disconnect bounds how long it waits for that reader
      (channels_redis 4.3 with redis-py 8 can swallow a cancellation inside its blocking pop).
    - The layer may go away (a Redis restart): the reader survives a failed receive, and the
      memberships go through the process's ``LayerWatch``, which re-adds them when Redis is
      back (execapp/layer_watch.py; docs/operations.md, "When Redis goes away").
    """

    conn: Connection | None = None
    owner = ""
    owner_tag = ""
    #: The worker this connection is counted on (its owner's quota), once it is.
    _counted_on: worker_module.Worker | None = None
    #: The credential this connection is watched for (closed once it is withdrawn), once it is.
    _watched: auth_watch.Key | None = None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        self.scope = scope
        self.base_send = send
        self.channel_layer = get_channel_layer(self.channel_layer_alias)
        self.channel_name = None
        self._reader: asyncio.Task | None = None
        self._watch: LayerWatch | None = None
        try:
            while True:
                message = await receive()
                # A client's frame goes straight to its connection: one coroutine per frame, not two
                # (``dispatch`` routes the rest, and the channel layer's messages).
                if message["type"] == "websocket.receive" and self.conn is not None:
                    await self.conn.receive(message.get("text"), message.get("bytes"))
                else:
                    await self.dispatch(message)
        except StopConsumer:
            pass
        finally:
            self._unwatch()
            await self._stop_reader()

    async def _parked(self, rest: Coroutine[Any, Any, Any]) -> None:
        """A frame's dispatch waiting for pool slots (policy "wait": up to OVERFLOW_WAIT_SECONDS for
        each of its handlers), awaited while the socket is watched. The consumer reads the next
        ASGI message (a disconnect too, queued behind the client's frames) only once a frame is
        done, so a client that left went unseen until every parked handler of its frame had a slot
        or its refusal: 30 clients that each sent a frame matching 100 handlers and left kept a
        worker's pool full for minutes. When the server says the socket is gone
        (``CONNECTION_LOST``, execapp.ws_flow), the dispatch is abandoned: the handlers not yet
        submitted never run, and the event completes once."""
        lost = self.scope.get("extensions", {}).get(CONNECTION_LOST)
        if lost is None:  # a server without it (bare uvicorn, daphne, the tests' communicator)
            await rest
            return
        task = asyncio.ensure_future(rest)
        watch = asyncio.ensure_future(lost.wait())
        try:
            await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                task.cancel()
            await asyncio.wait((task,))
        except BaseException:
            task.cancel()
            raise
        finally:
            watch.cancel()
        if not task.cancelled():
            task.result()

    async def dispatch(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        if kind == "websocket.receive":
            if self.conn is not None:
                await self.conn.receive(message.get("text"), message.get("bytes"))
        elif kind == "session.frame":
            await self.session_frame(message)
        elif kind == "websocket.connect":
            await self.websocket_connect(message)
        elif kind == "websocket.disconnect":
            await self.disconnect(message.get("code", 1000))
            raise StopConsumer()
        else:
            raise ValueError(f"no handler for message type {kind!r}")

    async def connect(self) -> None:
        """Set the connection up; a failure on the way is a close frame with a reason, never HTTP 500."""
        self._accepted = False
        try:
            await self._connect()
        except DatabaseError as exc:  # the first connection builds the worker, whose services may query it
            await self._refuse(CLOSE_TRY_AGAIN_LATER, database_unavailable(self.scope.get("path"), exc))
        except Exception as exc:
            _rare.exception(("connect", type(exc).__name__), "WebSocket %s failed to connect: %r",
                            self.scope.get("path"), exc)
            await self._refuse(CLOSE_INTERNAL_ERROR, f"internal error ({type(exc).__name__}); see the server log")

    async def _refuse(self, code: int, reason: str) -> None:
        """Close with ``code`` and ``reason``, accepting first if needed (a close before accept is a bare 403)."""
        if self.conn is not None:
            self.conn.close()
        if not self._accepted:
            await self.accept()
        await self.close(code, close_reason(reason))

    async def accept(self, subprotocol: str | None = None, headers: Any = None) -> None:
        """Accept the socket, remembering that it was (for ``_refuse``)."""
        await super().accept(subprotocol, headers)
        self._accepted = True

    async def _connect(self) -> None:
        """The connection's setup: its owner, its protocol state, the URL's sessions; then accept."""
        auth = self.scope.get("execapp_auth")
        if auth is None:  # the auth middleware is missing from the stack
            await self.close()
            return
        # The namespace of this client's session groups (execapp.auth sets it; a scope built by
        # hand without one still gets a namespace of its own identity, never a shared one).
        self.owner = auth.get("owner") or f"{auth.get('kind')}:{auth.get('name')}"
        self.owner_tag = owner_digest(self.owner)
        self._publishes = publish_slots(self.owner)
        worker = await aget_worker()
        limit = int(conf.get("MAX_CONNECTIONS_PER_OWNER"))
        if not worker.connection_opened(self.owner, limit):
            metrics.count_event(TOO_MANY_CONNECTIONS)
            _rare.log(logging.INFO, ("too_many_connections", self.owner), "refused WebSocket %s: %s already "
                      "holds %d connections to this worker", self.scope.get("path"), self.owner, limit)
            await self._refuse(CLOSE_POLICY_VIOLATION, f"too many connections: this owner already holds {limit} "
                                                       "connections to this worker (EXECAPP['MAX_CONNECTIONS_PER_"
                                                       "OWNER']); close some, or share one connection")
            return
        self._counted_on = worker
        protocol: Any = getattr(self.base_send, "__self__", None)
        if hasattr(protocol, "parse_key"):  # execapp.ws_flow: its reads' parse budget is its owner's
            protocol.parse_key = self.owner
        has_layer = self.channel_layer is not None
        self.conn = Connection(worker.engine, worker, Limits.from_settings(), self._send_text,
                               publish=self._publish if has_layer else None,
                               join=self._join if has_layer else None, owner=self.owner,
                               decode_share=worker.decode_share(self.owner, conf.get("DECODE_SHARE_PER_OWNER")),
                               pool_share=worker.pool_share(self.owner, conf.get("POOL_SHARE_PER_OWNER")),
                               outbox_budget=worker.outbox_budget(self.owner, int(conf.get("OWNER_OUTBOX_BYTES"))),
                               send_now=_send_now_of(self.base_send))
        self.conn.watch_parked = self._parked
        # Join the URL's sessions before accepting, so a client is a member once it is connected.
        problems = []
        query = parse_qs(self.scope.get("query_string", b"").decode("latin-1"))
        for value in query.get("session", []):
            for session in filter(None, value.split(",")):
                try:
                    await self.conn.join_session(check_session(session, "session (in the URL's ?session=)"))
                except ProtocolError as exc:
                    problems.append(exc)
        await self.accept()
        # Closed once its token is revoked, deleted or moved, or its user is no longer active staff
        # (execapp/auth_watch.py).
        self._watched = auth_watch.watch(auth, self._withdrawn)
        # Reported up to a few, then summed up: a URL naming thousands of sessions must not turn
        # into thousands of error frames queued past the outbox's limits (no backpressure here).
        for problem in problems[:_URL_PROBLEMS_SHOWN]:
            self.conn.error(problem.code, problem.message)
        if len(problems) > _URL_PROBLEMS_SHOWN:
            self.conn.error("bad_event", f"session (in the URL's ?session=): {len(problems) - _URL_PROBLEMS_SHOWN} "
                                         "more sessions were not joined (not shown); a connection joins at most "
                                         f"{MAX_SESSIONS_PER_CONNECTION} sessions, each 1-{MAX_SESSION_CHARS} "
                                         "characters of A-Z a-z 0-9 _ . -")

    async def disconnect(self, code: int) -> None:
        self._unwatch()
        if self._counted_on is not None:
            self._counted_on.connection_closed(self.owner)
            self._counted_on = None
        if self.conn is None:
            return
        self.conn.close()
        if self.channel_name is not None and self._watch is not None:
            for group in self.conn.groups():
                async with self._publishes:  # the owner's share of layer calls, as joins (_join)
                    await self._watch.discard(group, self.channel_name)  # never raises: a down layer expires it

    def _unwatch(self) -> None:
        if self._watched is not None:
            auth_watch.current().discard(self._watched, self._withdrawn)
            self._watched = None

    async def _withdrawn(self, reason: str) -> None:
        """Its credential was withdrawn (execapp/auth_watch.py): no more events are taken, and the
        socket is closed with 1008 and ``reason``."""
        self._watched = None
        if self.conn is None or self.conn.closed:  # it disconnected since the check: nothing to close
            return
        self.conn.close()
        try:
            await self.close(auth_watch.CLOSE_REVOKED, close_reason(reason))
        except Exception as exc:  # the socket went away while the close was being sent
            log.debug("closing a connection whose credential was withdrawn failed: %r", exc)

    def _send_text(self, text: str) -> Awaitable[None]:
        """Write one frame: the server's send itself, not a coroutine of ours around it (two per event)."""
        return self.base_send({"type": "websocket.send", "text": text})

    async def _join(self, group: str) -> None:
        channel, watch = self.channel_name, self._watch
        if channel is None or watch is None:
            channel = self.channel_name = await self.channel_layer.new_channel()
            watch = self._watch = watch_for(self.channel_layer)
            self._reader = asyncio.get_running_loop().create_task(self._read_layer(), name="execapp-ws-layer")
        # Remembered by the watch even while the layer is down (joined for real once it is back).
        # A join is a layer call like a publish: within the owner's share of them (publish_slots).
        # One tenant's 300 connections joining 32 sessions each at once held the layer's
        # connections until joins took over JOIN_TIMEOUT_SECONDS, and each worker judged the whole
        # layer down (every tenant's session frames undelivered until it re-added thousands of
        # memberships). Waiting for the share is outside the join's own timeout.
        async with self._publishes:
            await watch.add(group, channel)

    async def _read_layer(self) -> None:
        """Hand this connection's channel-layer messages (session frames) to dispatch, surviving
        the layer: a failed receive waits (off the layer) until the watch has it back, memberships
        re-added, then receives again."""
        watch = self._watch
        assert watch is not None and self.channel_name is not None
        backoff = _READER_BACKOFF_SECONDS[0]
        while True:
            try:
                message = await self.channel_layer.receive(self.channel_name)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if self._reader is None or isinstance(exc, ChannelReleased):
                    return  # stopped, its cancellation lost on the way (_stop_reader): not the layer's failure
                watch.failed(exc)
                await asyncio.sleep(backoff)  # an error the watch cannot see must not spin either
                backoff = min(backoff * 2, _READER_BACKOFF_SECONDS[1])
                await watch.wait_up()
                continue
            backoff = _READER_BACKOFF_SECONDS[0]
            if self._reader is None:
                return
            try:
                await self.dispatch(message)
            except Exception:
                log.exception("session message failed")

    async def _stop_reader(self) -> None:
        task, self._reader = self._reader, None
        for _ in range(3):
            if task is None or task.done():
                break
            task.cancel()
            await asyncio.wait({task}, timeout=_READER_STOP_SECONDS)
        else:
            # Its cancellation was lost (see execapp/redis_layer.py): once the channel is released, the
            # receive it is in ends at its next wake-up and the reader returns.
            log.debug("the channel-layer reader of %s did not stop at once; it ends once its receive wakes",
                      self.channel_name)
        # Frames sent to its sessions before it left them still arrive for it: without a reader,
        # the layer must not keep them (execapp/redis_layer.py).
        release = getattr(self.channel_layer, "release", None)
        if self.channel_name is not None and release is not None:
            release(self.channel_name)

    async def _publish(self, group: str, frame: str) -> None:
        # At most SESSION_PUBLISHES_PER_OWNER of this owner's publishes in flight on this worker: past
        # it this connection's session outbox fills and it stops being read (backpressure on its owner).
        async with self._publishes:
            # Shielded: a client leaving cancels its session outbox, and a cancellation that reaches
            # redis-py mid-command can be swallowed (Python 3.11's wait_for returns the command's
            # result instead), leaving the outbox's task "cancelling" but idle for ever (seen as a
            # hang when a test's loop closed). The send itself is short and ends on its own.
            await asyncio.shield(self.channel_layer.group_send(
                group, {"type": "session.frame", "frame": frame, "session": session_of(group),
                        "sender": self.channel_name, "owner": self.owner_tag}))

    async def session_frame(self, message: dict[str, Any]) -> None:
        """A frame of another member of one of this client's sessions (the sender has its own).

        Group names already separate owners; the owner tag is checked again here so that nothing
        else publishing on a shared channel layer can reach a client of another owner."""
        if (message.get("sender") != self.channel_name and message.get("owner") == self.owner_tag
                and self.conn is not None and not self.conn.closed and isinstance(message.get("frame"), str)):
            # Bounded: past the outbox's limits the frame is dropped and counted (a `lagged` frame
            # tells the member once it caught up).
            self.conn.session_frame(message["frame"], str(message.get("session") or ""))
