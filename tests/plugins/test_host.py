"""The host API: permissions, the HTTP allowlist with a real local server, caps and deadlines."""
from __future__ import annotations

import ipaddress
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from execapp.engine import HandlerError, HandlerTimeout
from plugins.errors import HostDenied
from plugins.loaded import LoadedPlugin
from plugins.runtimes.deadline_net import reachable
from plugins.runtimes.host import HTTP_MAX_BYTES, Host, HostCallError, host_allowed
from plugins.spec import PluginSpec


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802
        if self.path == "/big":
            body = b"x" * (HTTP_MAX_BYTES + 10)
        elif self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", "http://elsewhere.invalid/")
            self.end_headers()
            return
        elif self.path == "/to-localhost":  # an allowlisted name, but one that resolves to loopback
            self.send_response(302)
            self.send_header("Location", f"http://localhost:{self.server.server_address[1]}/")
            self.end_headers()
            return
        else:
            body = b"hello from the host"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def http_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def host(permissions=("http",), allow=("127.0.0.1",), timeout=2.0) -> Host:
    spec = PluginSpec(name="h", runtime="lua", code="", permissions=frozenset(permissions), http_allowlist=allow,
                      timeout=timeout)
    return Host(spec, time.monotonic() + timeout)


def test_http_get_reaches_an_allowlisted_host(http_server: str) -> None:
    assert host().http_get(http_server + "/") == "hello from the host"


def test_http_get_refuses_hosts_off_the_allowlist(http_server: str) -> None:
    with pytest.raises(HostDenied, match="not on plugin 'h'"):
        host(allow=("example.com",)).http_get(http_server + "/")
    with pytest.raises(HostDenied, match="redirect"):
        host().http_get(http_server + "/redirect")
    with pytest.raises(HostDenied, match="no 'http' permission"):
        host(permissions=("log",)).http_get(http_server + "/")


@pytest.mark.parametrize("address, public", [
    ("8.8.8.8", True), ("2606:4700::1111", True), ("2002:808:808::1", True),
    ("127.0.0.1", False), ("10.1.2.3", False), ("172.16.0.1", False), ("192.168.1.1", False),
    ("169.254.169.254", False), ("100.64.0.1", False), ("0.0.0.0", False), ("224.0.0.1", False),
    ("255.255.255.255", False), ("240.0.0.1", False), ("::1", False), ("::", False), ("fe80::1", False),
    ("fc00::1", False), ("fec0::1", False), ("ff02::1", False), ("::ffff:127.0.0.1", False),
    ("64:ff9b::7f00:1", False), ("2002:7f00:1::1", False), ("2001:db8::1", False),
])
def test_only_public_unicast_addresses_are_reachable(address: str, public: bool) -> None:
    assert reachable(ipaddress.ip_address(address)) is public
    if not public and ":" not in address:  # an operator's network makes it reachable
        assert reachable(ipaddress.ip_address(address), [ipaddress.ip_network(address)])


def test_a_name_that_resolves_to_a_non_public_address_is_refused(http_server: str, settings) -> None:
    """The allowlist names a host; whoever controls its DNS picks the address: loopback here,
    cloud metadata or an internal service in production."""
    port = http_server.rsplit(":", 1)[1]
    h = host(allow=("localhost",))
    with pytest.raises(HostDenied, match=r"'localhost' resolves only to .*non-public.*PLUGIN_HTTP_ALLOWED_NETWORKS"):
        h.http_get(f"http://localhost:{port}/")
    assert h.denied == 1
    # ... and so is a redirect from an allowed address to such a name.
    with pytest.raises(HostDenied, match="resolves only to"):
        host(allow=("127.0.0.1", "localhost")).http_get(http_server + "/to-localhost")
    # An operator can allow the network.
    settings.EXECAPP = {"PLUGIN_HTTP_ALLOWED_NETWORKS": "127.0.0.0/8"}
    assert host(allow=("localhost",)).http_get(f"http://localhost:{port}/") == "hello from the host"
    settings.EXECAPP = {"PLUGIN_HTTP_ALLOWED_NETWORKS": ["not-a-network"]}
    with pytest.raises(HostCallError, match="allowed networks are invalid.*'not-a-network' is not a network"):
        host().http_get(http_server + "/")


def test_an_address_reaches_only_itself_on_the_allowlist(http_server: str) -> None:
    assert host_allowed("::1", ("[::1]",)) and host_allowed("127.0.0.1", (" 127.0.0.1 ",))
    assert not host_allowed("127.0.0.1", ("*.0.0.1",)) and host_allowed("a.example.com", ("*.example.com",))
    with pytest.raises(HostDenied, match="not on plugin 'h'"):
        host(allow=("*.0.0.1",)).http_get(http_server + "/")


def test_http_get_caps_the_response(http_server: str) -> None:
    with pytest.raises(HostCallError, match="cap"):
        host().http_get(http_server + "/big")


def test_allowlist_wildcards() -> None:
    assert host_allowed("api.example.com", ("*.example.com",))
    assert host_allowed("example.com", ("*.example.com",))
    assert not host_allowed("evil-example.com", ("*.example.com",))
    assert not host_allowed("example.com.evil.org", ("example.com",))


def test_sleep_respects_the_deadline() -> None:
    h = host(permissions=("sleep",), timeout=0.2)
    h.sleep(10)
    from plugins.errors import GuestTimeout
    with pytest.raises(GuestTimeout):
        h.sleep(500)
    with pytest.raises(HostCallError):
        h.sleep(-1)


@pytest.mark.parametrize("runtime,code", [
    ("lua", 'function get(ev) return http_get(ev.args) end'),
    ("js", 'async function get(ev) { return await http_get(ev.args); }'),
])
def test_guests_call_http_get(runtime: str, code: str, http_server: str) -> None:
    loaded = LoadedPlugin(PluginSpec(name="web", runtime=runtime, code=code, permissions=frozenset({"http"}),
                                     http_allowlist=("127.0.0.1",)))
    event = {"args": http_server + "/", "text": "", "type": "message", "id": "1", "session": None, "data": {}}
    assert loaded.call("get", event) == "hello from the host"
    event["args"] = "http://example.com/"
    with pytest.raises(HandlerError, match="not on plugin 'web'.s HTTP allowlist"):
        loaded.call("get", event)


def test_guest_log_goes_to_the_plugins_logger(caplog) -> None:
    loaded = LoadedPlugin(PluginSpec(name="talk", runtime="lua", code='function t(e) log("hi " .. e.args) end'))
    caplog.set_level("INFO", logger="plugins.guest")
    assert loaded.call("t", {"args": "there"}) is None
    assert "[talk] hi there" in caplog.text


def test_a_pcall_cannot_swallow_a_sleep_timeout() -> None:
    code = 'function t(e) while true do pcall(sleep, 5000) end end'
    loaded = LoadedPlugin(PluginSpec(name="nap", runtime="lua", code=code, timeout=0.2,
                                     permissions=frozenset({"sleep"})))
    with pytest.raises(HandlerTimeout, match="sleep"):
        loaded.call("t", {"args": ""})


def test_kv_refuses_a_nul_in_a_key_or_a_value_before_touching_the_store() -> None:
    # PostgreSQL stores no NUL as text: refused alike on every database, with what to do instead.
    h = host(permissions=("kv",))
    with pytest.raises(HostCallError, match="must not contain a NUL"):
        h.kv_set("a\x00b", "v")
    with pytest.raises(HostCallError, match="encode binary data"):
        h.kv_set("k", "v\x00")
    with pytest.raises(HostCallError, match="must not contain a NUL"):
        h.kv_get("a\x00b")
    assert h.kv_writes == 0  # neither refused write counted against the quota


def test_host_text_refuses_a_lone_surrogate_with_what_to_send_instead() -> None:
    # A JS guest's string can hold one ("\ud800"); UTF-8 cannot encode it, and the store's own
    # encode failed with a bare codec message.
    h = host(permissions=("kv", "http"))
    with pytest.raises(HostCallError, match=r"kv_set: the value is not valid Unicode: a lone surrogate \(U\+D800\)"):
        h.kv_set("k", "ok \ud800")
    with pytest.raises(HostCallError, match=r"kv key is not valid Unicode: .*U\+DC00\) at character 1"):
        h.kv_get("a\udc00")
    with pytest.raises(HostCallError, match="http_get: the URL is not valid Unicode"):
        h.http_get("http://127.0.0.1/\ud800")
    assert h.kv_writes == 0 and h.http_requests == 0


def test_lua_host_arguments_that_are_not_utf8_get_a_clear_error_and_a_log_line_is_kept(caplog) -> None:
    code = ('function t(e) local ok, err = pcall(kv_set, "k", "\\xff\\xfe") log("bytes \\xff\\xc3 here \\u{e9}") '
            'return err end')
    loaded = LoadedPlugin(PluginSpec(name="bin", runtime="lua", code=code, permissions=frozenset({"kv", "log"})))
    caplog.set_level("INFO", logger="plugins.guest")
    assert loaded.call("t", {"args": ""}) == ("kv_set: argument 2 is not valid UTF-8 text; send text, or encode "
                                              "binary data (hex, base64)")
    assert "[bin] bytes ?? here ??" in caplog.text  # (its non-ASCII bytes, the valid ones too, become "?")
