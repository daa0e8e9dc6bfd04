"""Sessions belong to their owner: the same session name under two owners is two sessions.

An owner is a token's tenant (``ApiToken.tenant``, default: the token's own name) or, for a
staff session, its user. Checked at three levels: ``connection.Connection`` over a real in-memory
channel layer, the consumer behind the real auth middleware, and a real server with two tokens.
"""
from __future__ import annotations

import asyncio
import json
from io import StringIO
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from channels.layers import InMemoryChannelLayer
from channels.testing import WebsocketCommunicator
from django.core.management import CommandError, call_command

from execapp.connection import Connection
from execapp.engine import Engine, ExecPool
from execapp.protocol import GROUP_PREFIX, MAX_SESSION_CHARS, Limits, group_name, owner_digest
from execapp.routing import websocket_application
from tests.conftest import wait_until_async

from .ws_fixtures import Admission, Client, authed, channel_layer, ws_worker  # noqa: F401

TIMEOUT = 5.0


def msg(text: str, eid: str, **extra: Any) -> str:
    return json.dumps({"type": "message", "text": text, "id": eid, **extra})


# -- group names ----------------------------------------------------------------------------------

def test_group_names_differ_by_owner_and_stay_valid_channel_layer_names() -> None:
    session = "s" * MAX_SESSION_CHARS
    a, b = group_name("tenant:a", session), group_name("tenant:b", session)
    assert a != b and a.startswith(GROUP_PREFIX) and a.endswith("." + session)
    assert group_name("tenant:a", "room-1") != group_name("user:1", "room-1")
    # Channels: ASCII alnum, '-', '_', '.', under 100 characters; any owner string maps onto that.
    for owner in ("tenant:a", "user:7", "tenant:" + "é" * 500, "tenant:\x00 ;*"):
        name = group_name(owner, session)
        InMemoryChannelLayer().require_valid_group_name(name)
        assert len(name) < 100 and owner_digest(owner) in name


def test_a_connection_with_session_groups_needs_an_owner() -> None:
    async def go() -> None:
        async def noop(*args: Any) -> None:
            pass

        with pytest.raises(ValueError, match="owner"):
            Connection(Engine(pool_enabled=False), None, Limits(), noop, publish=noop, join=noop)

    asyncio.run(go())


# -- connection.Connection over a real in-memory channel layer ------------------------------------

class LayerClient:
    """A Connection wired to a channel layer the way the consumer wires it, collecting every frame."""

    def __init__(self, engine: Engine, layer: InMemoryChannelLayer, owner: str) -> None:
        self.layer, self.frames = layer, []
        self.channel: str | None = None
        self.reader: asyncio.Task | None = None
        self.conn = Connection(engine, Admission(), Limits(), self._send, publish=self._publish, join=self._join,
                               owner=owner)

    async def _send(self, text: str) -> None:
        self.frames.append(json.loads(text))

    async def _join(self, group: str) -> None:
        if self.channel is None:
            self.channel = await self.layer.new_channel()
            self.reader = asyncio.get_running_loop().create_task(self._read())
        await self.layer.group_add(group, self.channel)

    async def _publish(self, group: str, frame: str) -> None:
        await self.layer.group_send(group, {"type": "session.frame", "frame": frame, "sender": self.channel})

    async def _read(self) -> None:
        while True:
            message = await self.layer.receive(self.channel)
            if message["sender"] != self.channel:
                self.frames.append(json.loads(message["frame"]))

    def ids(self, kind: str = "done") -> list[str]:
        return [f["id"] for f in self.frames if f["type"] == kind]

    def close(self) -> None:
        self.conn.close()
        if self.reader is not None:
            self.reader.cancel()


async def _until(predicate: Any) -> None:
    assert await wait_until_async(predicate, TIMEOUT, interval=0.005), "not reached in time"


async def _delivered(clients: list[LayerClient]) -> None:
    """Return once everything already sent to these clients' channels has reached them: a marker
    sent now arrives after it (an in-memory channel is a FIFO queue)."""
    for c in clients:
        if c.channel is not None:
            marker = json.dumps({"type": "marker", "id": c.channel})
            await c.layer.send(c.channel, {"type": "session.frame", "frame": marker, "sender": "test"})
    await _until(lambda: all(c.channel is None or c.channel in c.ids("marker") for c in clients))


async def test_two_owners_sharing_a_session_name_never_see_each_others_frames() -> None:
    engine = Engine(pool=ExecPool(4, 16, 0.5))
    engine.add(engine.make_matcher("command", "echo", lambda ctx: ctx.args, name="echo"))
    layer = InMemoryChannelLayer()
    alice, alice2 = LayerClient(engine, layer, "tenant:a"), LayerClient(engine, layer, "tenant:a")
    mallory = LayerClient(engine, layer, "tenant:m")
    try:
        # Both listeners join "room-1" the way ?session= does; mallory also sends in it.
        await alice2.conn.join_session("room-1")
        await mallory.conn.join_session("room-1")
        await alice.conn.receive(msg("/echo secret", "a1", session="room-1"))
        await mallory.conn.receive(msg("/echo mine", "m1", session="room-1"))
        await _until(lambda: "a1" in alice2.ids() and "m1" in mallory.ids() and "a1" in alice.ids())
        await _delivered([alice, alice2, mallory])  # a stray group frame, already sent, has arrived by now
        assert [f.get("text") for f in alice2.frames if f["type"] == "reply"] == ["secret"]
        assert mallory.ids("reply") == ["m1"] and "a1" not in mallory.ids()  # at join AND at send
        assert "m1" not in alice.ids() and "m1" not in alice2.ids()
        assert alice.ids() == ["a1"]  # the sender gets its own frames once
    finally:
        for c in (alice, alice2, mallory):
            c.close()
        engine.pool.drain(5)  # type: ignore[union-attr]


async def test_handlers_see_the_sender_s_tenant_and_a_client_cannot_name_one() -> None:
    """event.tenant: the same opaque id for every connection of one owner, another for another
    owner (per-sender state, e.g. a plugin's notes per session, keyed by it stays apart), set by
    the server: a frame that names a tenant is refused."""
    engine = Engine(pool=ExecPool(4, 16, 0.5))
    engine.add(engine.make_matcher("command", "whoami", lambda ctx: ctx.event.tenant, name="whoami"))
    layer = InMemoryChannelLayer()
    alice, alice2 = LayerClient(engine, layer, "tenant:a"), LayerClient(engine, layer, "tenant:a")
    mallory = LayerClient(engine, layer, "tenant:m")
    try:
        for n, client in enumerate((alice, alice2, mallory)):
            await client.conn.receive(msg("/whoami", f"w{n}", session="room-1"))
        await mallory.conn.receive(msg("/whoami", "forged", tenant=owner_digest("tenant:a")))
        await _until(lambda: "w0" in alice.ids() and "w1" in alice2.ids() and "w2" in mallory.ids()
                     and "forged" in mallory.ids("error"))
        seen = [next(f["text"] for f in c.frames if f["type"] == "reply") for c in (alice, alice2, mallory)]
        assert seen[0] == seen[1] == owner_digest("tenant:a") and seen[2] == owner_digest("tenant:m")
        forged = next(f for f in mallory.frames if f.get("id") == "forged")
        assert forged["code"] == "bad_event" and "tenant: unknown field" in forged["message"]
    finally:
        for c in (alice, alice2, mallory):
            c.close()
        engine.pool.drain(5)  # type: ignore[union-attr]


# -- the consumer behind the real auth middleware -------------------------------------------------

def owned(owner: str, kind: str = "token") -> Any:
    """EventConsumer as if the auth middleware had let in a client of ``owner``."""
    return authed({"execapp_auth": {"kind": kind, "name": owner, "owner": owner}})


@pytest.mark.usefixtures("ws_worker")
@pytest.mark.parametrize("channel_layer", ["memory"], indirect=True)
async def test_the_url_session_and_the_event_session_are_both_namespaced(channel_layer: str) -> None:
    async with Client(app=owned("tenant:a")) as sender, \
            Client("/ws/events/?session=room-1", app=owned("tenant:a")) as friend, \
            Client("/ws/events/?session=room-1", app=owned("tenant:m")) as url_spy:
        async with Client(app=owned("tenant:m")) as event_spy:
            await event_spy.send(msg("/ping", "spy", session="room-1"))  # joins by sending in it
            await event_spy.until_done("spy")
            await url_spy.until_done("spy")  # the same owner: it hears that one
            await sender.send(msg("/echo secret", "a1", session="room-1"))
            await sender.until_done("a1")
            heard = await friend.until_done("a1")
            assert [f["type"] for f in heard] == ["reply", "done"] and heard[0]["text"] == "secret"
            assert await url_spy.nothing(0.2) and await event_spy.nothing(0.05)
        # The other owner's own session traffic stays among its members too.
        async with Client(app=owned("tenant:m")) as m:
            await m.send(msg("/ping", "m1", session="room-1"))
            assert (await url_spy.until_done("m1"))[-1]["type"] == "done"
            assert await friend.nothing(0.1)


@pytest.fixture
def tokens(transactional_db: Any) -> dict[str, str]:
    from execapp.models import ApiToken

    return {"a": ApiToken.issue("alice-laptop", "acme")[1], "a2": ApiToken.issue("alice-phone", "acme")[1],
            "m": ApiToken.issue("mallory")[1]}


async def _connect(headers: list, path: str = "/ws/events/") -> WebsocketCommunicator:
    comm = WebsocketCommunicator(websocket_application, path, headers=headers)
    connected, code = await comm.connect(timeout=TIMEOUT)
    assert connected, code
    return comm


async def _frames_until_done(comm: WebsocketCommunicator, eid: str) -> list[dict]:
    frames = []
    while not frames or frames[-1]["type"] != "done" or frames[-1]["id"] != eid:
        frames.append(json.loads(await comm.receive_from(TIMEOUT)))
    return frames


def _session_cookie() -> str:
    from django.contrib.auth import get_user_model
    from django.test import Client as HttpClient

    user = get_user_model().objects.create_user("staff-owner", is_staff=True)  # no password: no hashing cost
    http = HttpClient()
    http.force_login(user)
    return http.cookies["sessionid"].value


@pytest.mark.usefixtures("ws_worker")
@pytest.mark.parametrize("channel_layer", ["memory"], indirect=True)
async def test_tokens_of_one_tenant_share_sessions_and_other_tokens_and_staff_do_not(
        channel_layer: str, tokens: dict[str, str]) -> None:
    def bearer(raw: str) -> list:
        return [(b"authorization", f"Bearer {raw}".encode())]

    cookie = await sync_to_async(_session_cookie)()
    staff = [(b"host", b"testserver"), (b"origin", b"http://testserver"), (b"cookie", f"sessionid={cookie}".encode())]
    sender = await _connect(bearer(tokens["a"]))
    friend = await _connect(bearer(tokens["a2"]), "/ws/events/?session=room-1")
    spy = await _connect(bearer(tokens["m"]), "/ws/events/?session=room-1")
    admin = await _connect(staff, "/ws/events/?session=room-1")
    try:
        await sender.send_to(text_data=msg("/echo secret", "a1", session="room-1"))
        await _frames_until_done(sender, "a1")
        assert [f.get("text") for f in await _frames_until_done(friend, "a1")] == ["secret", None]
        assert await spy.receive_nothing(0.2) and await admin.receive_nothing(0.05)
        # A staff session is its own owner: its session "room-1" is not the tokens' either.
        await admin.send_to(text_data=msg("/echo staff", "s1", session="room-1"))
        await _frames_until_done(admin, "s1")
        assert await spy.receive_nothing(0.1) and await friend.receive_nothing(0.05)
    finally:
        for comm in (sender, friend, spy, admin):
            await comm.disconnect()


# -- tokens: tenant, create_token, migration ------------------------------------------------------

@pytest.mark.django_db
def test_a_token_is_its_own_tenant_unless_given_one() -> None:
    from execapp.models import ApiToken

    out, err = StringIO(), StringIO()
    call_command("create_token", "solo", stdout=out, stderr=err)
    call_command("create_token", "member", "--tenant", " acme ", stdout=StringIO(), stderr=StringIO())
    assert ApiToken.objects.get(name="solo").tenant == "solo" and "of tenant 'solo'" in out.getvalue()
    assert ApiToken.objects.get(name="member").tenant == "acme"
    assert ApiToken.objects.get(name="member").owner == "tenant:acme"
    # The admin's add form may leave the tenant blank: saving fills in the name.
    token = ApiToken(name="from-form", token_hash="h" * 64, prefix="p")
    token.save()
    assert token.tenant == "from-form"
    with pytest.raises(CommandError, match="at most 100"):
        call_command("create_token", "long", "--tenant", "t" * 101, stdout=StringIO(), stderr=StringIO())


@pytest.mark.django_db(transaction=True)
def test_the_migration_makes_each_existing_token_its_own_owner() -> None:
    from django.db import connection
    from django.db.migrations.executor import MigrationExecutor

    executor = MigrationExecutor(connection)
    latest = executor.loader.graph.leaf_nodes()
    try:
        executor.migrate([("execapp", "0002_observability")])
        old = executor.loader.project_state([("execapp", "0002_observability")]).apps.get_model("execapp", "ApiToken")
        old.objects.create(name="legacy-1", token_hash="1" * 64, prefix="p1")
        old.objects.create(name="legacy-2", token_hash="2" * 64, prefix="p2")
        executor = MigrationExecutor(connection)
        executor.migrate([("execapp", "0003_apitoken_tenant")])
        new = executor.loader.project_state([("execapp", "0003_apitoken_tenant")]).apps.get_model("execapp",
                                                                                                  "ApiToken")
        assert dict(new.objects.values_list("name", "tenant")) == {"legacy-1": "legacy-1", "legacy-2": "legacy-2"}
    finally:
        executor = MigrationExecutor(connection)
        executor.migrate(latest)


# -- a real server, two tokens --------------------------------------------------------------------

@pytest.mark.e2e
def test_a_real_server_keeps_two_tenants_sessions_apart(tmp_path: Any, asgi_server_factory: Any) -> None:
    from websockets.sync.client import connect

    from tests.conftest import manage

    # One subprocess migrates and issues the three tokens (each manage.py command starts Django).
    env = {"DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite3'}", "REDIS_URL": ""}
    result = manage("shell", "-c", "from django.core.management import call_command\n"
                    "call_command('migrate', verbosity=0)\nfrom execapp.models import ApiToken\n"
                    "for name, tenant in (('alice', 'acme'), ('alice-2', 'acme'), ('mallory', 'evil')):\n"
                    "    print(ApiToken.issue(name, tenant)[1])", env=env)
    assert result.returncode == 0, result.stderr
    a, a2, m = result.stdout.split()[-3:]
    server = asgi_server_factory({**env, "DJANGO_SETTINGS_MODULE": "tests.execapp.e2e_settings"})
    url = f"{server.ws_url}/ws/events/"

    def frames_until_done(ws: Any, eid: str) -> list[dict]:
        frames: list[dict] = []
        while not frames or frames[-1]["type"] != "done" or frames[-1]["id"] != eid:
            frames.append(json.loads(ws.recv(TIMEOUT)))
        return frames

    def silent(ws: Any, wait: float) -> bool:
        try:
            ws.recv(wait)
        except TimeoutError:
            return True
        return False

    with connect(url, additional_headers={"Authorization": f"Bearer {a}"}) as sender, \
            connect(url + "?session=room-1", additional_headers={"Authorization": f"Bearer {a2}"}) as friend, \
            connect(url + "?session=room-1", additional_headers={"Authorization": f"Bearer {m}"}) as spy:
        spy.send(msg("/ping", "spy", session="room-1"))  # and by sending in it
        frames_until_done(spy, "spy")
        sender.send(msg("/echo secret", "a1", session="room-1"))
        frames_until_done(sender, "a1")
        assert [f.get("text") for f in frames_until_done(friend, "a1")] == ["secret", None]
        assert silent(spy, 0.3)
        spy.send(msg("/echo spam", "m1", session="room-1"))
        frames_until_done(spy, "m1")
        assert silent(friend, 0.2) and silent(sender, 0.05)
