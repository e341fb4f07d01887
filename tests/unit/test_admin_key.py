"""``server.admin_api_key``: every /admin route of the app refuses the users' key and takes the admin
key; /v1 takes the users' key and refuses the admin key (serving/app.py's ApiKeyMiddleware)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.unit

USERS, ADMIN = "users-key", "admin-key"


@pytest.fixture(scope="module")
def app_and_routes(tmp_path_factory):
    from prometheus_client import CollectorRegistry

    from dynamo_spec.config.settings import Settings
    from dynamo_spec.serving.app import create_app
    from dynamo_spec.serving.lifecycle import Lifecycle

    settings = Settings(engine={"model": "m"}, speculative={"model": "d", "suffix": {"enabled": True},
                                                              "guard": {"enabled": True},
                                                              "draft_budget": {"enabled": True}},
                        server={"api_key": USERS, "admin_api_key": ADMIN},
                        learning={"dir": str(tmp_path_factory.mktemp("learning"))})
    app = create_app(settings, Lifecycle(), None, [CollectorRegistry()])
    routes = sorted({(m, r.path) for r in app.routes if r.path.startswith("/admin")
                     for m in getattr(r, "methods", ()) if m != "HEAD"})
    return app, routes


def test_the_app_has_the_admin_routes(app_and_routes):
    paths = {p for _, p in app_and_routes[1]}
    assert {"/admin/suffix", "/admin/draft", "/admin/learning/captures", "/admin/speculation"} <= paths, paths


def test_every_admin_route_refuses_the_users_key_and_takes_the_admin_key(app_and_routes):
    from fastapi.testclient import TestClient

    app, routes = app_and_routes
    with TestClient(app) as http:
        for method, path in routes:
            for key in (USERS, None, "wrong"):
                headers = {"Authorization": f"Bearer {key}"} if key else {}
                r = http.request(method, path, headers=headers, json={})
                assert r.status_code == 401, (method, path, key, r.status_code)
                assert r.json()["error"]["type"] == "Unauthorized"
            r = http.request(method, path, headers={"Authorization": f"Bearer {ADMIN}"}, json={})
            assert r.status_code != 401, (method, path, r.text)


def test_v1_takes_the_users_key_only(app_and_routes):
    from fastapi.testclient import TestClient

    with TestClient(app_and_routes[0]) as http:
        assert http.get("/v1/models", headers={"Authorization": f"Bearer {ADMIN}"}).status_code == 401
        assert http.get("/v1/models", headers={"Authorization": f"Bearer {USERS}"}).status_code != 401


def test_the_automatic_cycles_config_holds_neither_key():
    from dynamo_spec.config.settings import Settings
    from dynamo_spec.learning.auto import child_config

    settings = Settings(engine={"model": "m"}, speculative={"model": "d"}, server={"api_key": USERS, "admin_api_key": ADMIN})
    text = child_config(settings)
    assert USERS not in text and ADMIN not in text
