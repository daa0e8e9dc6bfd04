"""Admin permissions: every action and view that changes a plugin, binding, token or KV entry needs
the matching change/delete permission. Django hides an action the user may not run and answers a
forged POST with "No action selected", so the tests assert on the data, not on a status code."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import pytest
from django.contrib.auth.models import Permission, User
from django.test import Client

from execapp.models import ApiToken
from plugins.models import Binding, KVEntry, Plugin

pytestmark = pytest.mark.django_db

LUA = "function ping(ev) return 'pong' end\nfunction pong(ev) return 'ping' end"
PLUGINS = "/admin/plugins/plugin/"
TOKENS = "/admin/execapp/apitoken/"
KV = "/admin/plugins/kventry/"
#: What a view-only operator holds: every model the admin shows, to look at, nothing more.
VIEW_ONLY = ["plugins.view_plugin", "plugins.view_binding", "plugins.view_kventry", "execapp.view_apitoken"]


def staff(name: str, perms: list[str]) -> Client:
    """A logged-in client of an active staff user holding exactly ``perms`` ("app.codename")."""
    user = User.objects.create_user(name, is_staff=True)  # no password: no hashing cost
    for perm in perms:
        app, _, codename = perm.partition(".")
        user.user_permissions.add(Permission.objects.get(content_type__app_label=app, codename=codename))
    client = Client()
    client.force_login(user)
    return client


def lua_plugin(name: str = "p", enabled: bool = True) -> Plugin:
    plugin = Plugin.objects.create(name=name, runtime="lua", source=LUA, enabled=enabled)
    Binding.objects.create(plugin=plugin, pattern="ping", handler="ping")
    return plugin


@dataclass
class Case:
    """One admin action: the objects it acts on, the permission it needs, and its effect on the data."""

    url: str
    action: str
    needs: str  # "app.codename"
    make: Callable[[], Any]
    done: Callable[[Any], bool]  # True once the action took effect on the object

    def post(self, client: Client, obj: Any) -> Any:
        data = {"action": self.action, "_selected_action": [obj.pk]}
        if self.action == "delete_selected":
            data["post"] = "yes"  # the confirmation page's answer: delete now
        return client.post(self.url, data, follow=True)

    def offered(self, client: Client) -> bool:
        return f'value="{self.action}"' in client.get(self.url).content.decode()


def _gone(model: Any) -> Callable[[Any], bool]:
    return lambda obj: not model.objects.filter(pk=obj.pk).exists()


CASES = {
    "disable plugins": Case(PLUGINS, "disable_plugins", "plugins.change_plugin", lambda: lua_plugin(),
                            lambda p: not Plugin.objects.get(pk=p.pk).enabled),
    "enable plugins": Case(PLUGINS, "enable_plugins", "plugins.change_plugin", lambda: lua_plugin(enabled=False),
                           lambda p: Plugin.objects.get(pk=p.pk).enabled),
    "delete plugins": Case(PLUGINS, "delete_selected", "plugins.delete_plugin", lambda: lua_plugin(),
                           _gone(Plugin)),
    "revoke tokens": Case(TOKENS, "revoke_tokens", "execapp.change_apitoken", lambda: ApiToken.issue("t1")[0],
                          lambda t: ApiToken.objects.get(pk=t.pk).revoked_at is not None),
    "delete tokens": Case(TOKENS, "delete_selected", "execapp.delete_apitoken", lambda: ApiToken.issue("t1")[0],
                          _gone(ApiToken)),
    "delete kv entries": Case(KV, "delete_selected", "plugins.delete_kventry",
                              lambda: KVEntry.objects.create(plugin="p", key="k", value="v"), _gone(KVEntry)),
}


def _others_of_the_model(perm: str) -> list[str]:
    """Every permission of ``perm``'s model except ``perm`` itself (add, change, delete, view)."""
    app, _, codename = perm.partition(".")
    model = codename.partition("_")[2]
    return [f"{app}.{verb}_{model}" for verb in ("add", "change", "delete", "view") if f"{verb}_{model}" != codename]


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_a_view_only_user_cannot_run_the_action(case: Case) -> None:
    obj = case.make()
    client = staff("viewer", VIEW_ONLY)
    assert not case.offered(client)  # hidden from the action menu
    case.post(client, obj)  # forged: the action named anyway
    assert not case.done(obj), f"{case.action} ran for a view-only user"


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_every_other_permission_of_the_model_is_not_enough(case: Case) -> None:
    obj = case.make()
    client = staff("almost", VIEW_ONLY + _others_of_the_model(case.needs))
    assert not case.offered(client)
    case.post(client, obj)
    assert not case.done(obj), f"{case.action} ran without {case.needs}"


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_a_user_holding_the_permission_runs_the_action(case: Case) -> None:
    obj = case.make()
    client = staff("holder", VIEW_ONLY + [case.needs])
    assert case.offered(client)
    case.post(client, obj)
    assert case.done(obj), f"{case.action} did not run for a user holding {case.needs}"


# -- the change forms (plugin with its binding inline, token, KV entry) ----------------------------

def form_data(response: Any) -> dict[str, Any]:
    """The POST data that submits an admin change form as rendered (main form and every inline)."""
    data: dict[str, Any] = {}

    def add(form: Any) -> None:
        for field in form:
            if getattr(field.field.widget, "input_type", None) == "file":
                continue  # uploads: nothing to resubmit
            value = field.field.prepare_value(field.value())
            if value is None:
                continue
            if isinstance(value, bool):
                if value:
                    data[field.html_name] = "on"
            elif isinstance(value, (list, tuple)):
                data[field.html_name] = [str(v) for v in value]
            else:
                data[field.html_name] = str(value)

    add(response.context["adminform"].form)
    for inline in response.context["inline_admin_formsets"]:
        formset = inline.formset
        add(formset.management_form)
        for form in formset.forms:
            add(form)
    return data


@pytest.fixture
def admin(db: None) -> Client:
    client = Client()
    client.force_login(User.objects.create_superuser("root", "root@example.com", None))
    return client


def _change_url(base: str, obj: Any) -> str:
    return f"{base}{obj.pk}/change/"


def test_the_plugin_change_form_needs_change_plugin(admin: Client) -> None:
    plugin = lua_plugin()
    data = form_data(admin.get(_change_url(PLUGINS, plugin)))
    data.pop("enabled", None)  # unchecked: disable it
    data["description"] = "edited"
    staff("viewer", VIEW_ONLY).post(_change_url(PLUGINS, plugin), data)
    plugin.refresh_from_db()
    assert plugin.enabled and plugin.description == ""
    response = staff("holder", VIEW_ONLY + ["plugins.change_plugin"]).post(_change_url(PLUGINS, plugin), data)
    assert response.status_code == 302, response.content.decode()[-3000:]
    plugin.refresh_from_db()
    assert not plugin.enabled and plugin.description == "edited"


def test_an_inline_binding_needs_change_binding(admin: Client) -> None:
    plugin = lua_plugin()
    binding = plugin.bindings.get()
    data = form_data(admin.get(_change_url(PLUGINS, plugin)))
    prefix = next(k for k, v in data.items() if k.endswith("-handler") and v == "ping").rpartition("-")[0]
    data[f"{prefix}-pattern"], data[f"{prefix}-handler"] = "hijack", "pong"
    # May change the plugin, may only look at its bindings: the plugin saves, the binding does not.
    response = staff("plugin-editor", VIEW_ONLY + ["plugins.change_plugin"]).post(_change_url(PLUGINS, plugin), data)
    assert response.status_code == 302, response.content.decode()[-3000:]
    binding.refresh_from_db()
    assert (binding.pattern, binding.handler) == ("ping", "ping")
    data = form_data(admin.get(_change_url(PLUGINS, plugin)))  # the page again: the one above is stale now
    data[f"{prefix}-pattern"], data[f"{prefix}-handler"] = "hijack", "pong"
    staff("binder", VIEW_ONLY + ["plugins.change_plugin", "plugins.change_binding"]).post(
        _change_url(PLUGINS, plugin), data)
    binding.refresh_from_db()
    assert (binding.pattern, binding.handler) == ("hijack", "pong")


def test_the_kv_change_form_needs_change_kventry(admin: Client) -> None:
    entry = KVEntry.objects.create(plugin="p", key="k", value="v")
    data = form_data(admin.get(_change_url(KV, entry)))
    data["value"] = "forged"
    assert staff("viewer", VIEW_ONLY).post(_change_url(KV, entry), data).status_code == 403
    entry.refresh_from_db()
    assert entry.value == "v"
    staff("holder", VIEW_ONLY + ["plugins.change_kventry"]).post(_change_url(KV, entry), data)
    entry.refresh_from_db()
    assert entry.value == "forged"


def test_tokens_are_added_only_with_add_apitoken(admin: Client) -> None:
    staff("viewer", VIEW_ONLY + ["execapp.change_apitoken"]).post(f"{TOKENS}add/", {"name": "sneaky"})
    assert not ApiToken.objects.filter(name="sneaky").exists()
    staff("issuer", VIEW_ONLY + ["execapp.add_apitoken"]).post(f"{TOKENS}add/", {"name": "issued"})
    assert ApiToken.objects.filter(name="issued").exists()


def test_every_admin_page_opens_for_a_user_who_may_only_view_it(admin: Client) -> None:
    """Each registered model's list and change page answer 200 to staff holding only its view
    permission (the plugin page's form assumed the editable fields: a 500 for view-only operators)."""
    from django.contrib import admin as django_admin

    from execapp.models import ExecProfileRecord

    objects = [lua_plugin(), KVEntry.objects.create(plugin="p", key="k", value="v"),
               ApiToken.objects.create(name="t", token_hash="0" * 64, prefix="00000000"),
               ExecProfileRecord.objects.create(matcher="command:ping", plugin="p", last_error="boom")]
    opened = []
    for obj in objects:
        meta = type(obj)._meta
        assert type(obj) in django_admin.site._registry, meta.label
        viewer = staff(f"viewer-{meta.model_name}", [f"{meta.app_label}.view_{meta.model_name}"])
        base = f"/admin/{meta.app_label}/{meta.model_name}/"
        for url in (base, _change_url(base, obj)):
            response = viewer.get(url)
            assert response.status_code == 200, (url, response.status_code)
            opened.append(url)
        assert viewer.post(_change_url(base, obj), {}).status_code == 403  # looking is all it may do
    assert len(opened) == 8


def test_a_profiles_last_error_needs_the_events_permission() -> None:
    """A persisted profile's last error is a plugin's text about a tenant's event: without
    view_eventtrace it is neither shown nor searchable (a search would reveal it a guess at a time)."""
    from execapp.models import ExecProfileRecord

    record = ExecProfileRecord.objects.create(matcher="command:pay", plugin="p", last_error="card 4111 of acme")
    page = _change_url("/admin/execapp/execprofilerecord/", record)
    search = "/admin/execapp/execprofilerecord/?q=4111"
    viewer = staff("profiles-only", ["execapp.view_execprofilerecord"])
    shown = viewer.get(page)
    assert shown.status_code == 200 and "4111" not in shown.content.decode()
    assert "needs the &#x27;Can view event&#x27; permission" in shown.content.decode()
    assert "command:pay" not in viewer.get(search).content.decode()
    reader = staff("events-reader", ["execapp.view_execprofilerecord", "execapp.view_eventtrace"])
    assert "card 4111 of acme" in reader.get(page).content.decode()
    assert "command:pay" in reader.get(search).content.decode()


def test_a_staff_user_without_permissions_opens_no_model_view_but_the_dashboard() -> None:
    """Every URL every registered ModelAdmin serves (lists, rows, history, add, delete, custom
    views), filled with a real row's id: a staff user holding no permission gets none of them, the
    live dashboard's page and data (open to all staff, docs/operations.md) aside."""
    from django.contrib import admin as django_admin
    from django.urls import URLPattern
    from django.utils import timezone

    from execapp.models import EventTrace, ExecProfileRecord

    rows = [lua_plugin(), KVEntry.objects.create(plugin="p", key="k", value="v"),
            ApiToken.objects.create(name="t", token_hash="0" * 64, prefix="00000000"),
            ExecProfileRecord.objects.create(matcher="command:ping", plugin="p", last_error="boom"),
            EventTrace.objects.create(uid="w-1", event_id="e1", owner="acme", outcome="failed", codes="x",
                                      created_at=timezone.now())]
    pks = {type(r): str(r.pk) for r in rows}
    nobody = staff("nobody", [])
    opened, checked = [], []
    for model, model_admin in django_admin.site._registry.items():
        base = f"/admin/{model._meta.app_label}/{model._meta.model_name}/"
        pk = pks.get(model) or pks.get(model._meta.concrete_model) or "1"
        for pattern in model_admin.get_urls():
            assert isinstance(pattern, URLPattern)
            route = str(pattern.pattern)
            url = base + route.replace("<path:object_id>", pk).replace("<int:pk>", pk).replace("<id>", pk)
            assert "<" not in url, route  # a parameter this test does not fill: extend it
            checked.append(url)
            if nobody.get(url).status_code == 200:
                opened.append(url)
    assert len(checked) >= 30  # 9 models' lists, rows, add, history, delete and custom views
    assert sorted(opened) == ["/admin/execapp/dashboard/", "/admin/execapp/dashboard/data/"]
