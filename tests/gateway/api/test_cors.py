"""CORS as a browser sees it (gateway/http/cors.py): preflights and simple requests for each
`http.cors_origins` mode, through the gateway's app (no workers: the answers CORS wraps need none);
and headless Chromium (where it is installed: .ci/run installs it) on a page of another origin making
credentialed cross-origin `fetch`es."""

from __future__ import annotations

import contextlib
import functools
import http.server
import shutil
import subprocess
import threading
import uuid
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from gateway.api.app import create_app
from gateway.catalog import Catalog
from gateway.compose import Gateway
from gateway.config import ConfigError
from gateway.tenancy.ratelimit import RateLimiter
from tests.gateway.fake_pool import FakePool
from tests.gateway.gateway_setup import KEYS, auth, tiny_config
from tests.gateway.live_server import live_server

PREFLIGHT = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
LOCAL = ["http://localhost", "http://localhost:8080", "https://localhost:3000", "http://127.0.0.1",
         "http://127.0.0.1:3000", "http://[::1]", "http://[::1]:3000"]
NOT_LOCAL = ["http://web.mydomain.fr", "http://evil.com", "http://notlocalhost", "http://localhost.evil.com",
             "http://127.0.0.1.evil.com", "web.mydomain.fr", "localhost", "file://localhost"]


@pytest.fixture(scope="module")
def app_with(tiny_llama, tmp_path_factory):
    """The gateway's app with `http` settings of the test's own (a fake pool: CORS needs no worker)."""

    def make(**http):
        directory = tmp_path_factory.mktemp("cors")
        config = tiny_config(tiny_llama, directory, f"loraplex-test-{uuid.uuid4().hex}",
                             http={"max_body_bytes": 4096, **http})
        app = create_app()
        app.state.gateway = Gateway(config, Catalog(config), FakePool(config), RateLimiter())
        return app

    return make


@contextlib.contextmanager
def client_with(app_with, **http) -> Iterator[TestClient]:
    with TestClient(app_with(**http)) as client:
        yield client


def preflight(client: TestClient, origin: str, path: str = "/completions", **headers: str):
    return client.options(path, headers={"Origin": origin, **PREFLIGHT, **headers})


def test_any_origin_is_reflected_with_credentials_as_llama_server_does(app_with) -> None:
    with client_with(app_with, cors_credentials=True) as client:  # ["*"] (the default) with credentials: llama-server's
        for origin in ("http://app.example.com:5173", "web.mydomain.fr", "localhost", "null"):
            answer = preflight(client, origin)
            assert answer.status_code == 200 and answer.content == b""
            assert answer.headers["access-control-allow-origin"] == origin
            assert answer.headers["access-control-allow-credentials"] == "true"
            assert answer.headers["access-control-allow-methods"] == "GET, POST, DELETE, OPTIONS"
            assert answer.headers["access-control-allow-headers"] == "authorization,content-type"  # what it asked
            assert "Origin" in answer.headers["vary"]
        simple = client.get("/v1/models", headers={"Origin": "http://app.example.com", **auth()})
        assert simple.status_code == 200 and simple.json()["data"]
        assert simple.headers["access-control-allow-origin"] == "http://app.example.com"
        assert simple.headers["access-control-allow-credentials"] == "true"
        assert "Origin" in simple.headers["vary"]
        refused = client.get("/v1/models", headers={"Origin": "http://app.example.com"})  # no key
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "missing_api_key"
        assert refused.headers["access-control-allow-origin"] == "http://app.example.com"  # the page reads the error
        assert "access-control-allow-origin" not in client.get("/v1/models", headers=auth()).headers  # no Origin
        patch = preflight(client, "http://a.example", "/v1/tenants/t1", **{"Access-Control-Request-Method": "PATCH"})
        assert patch.headers["access-control-allow-methods"] == "GET, POST, DELETE, OPTIONS, PATCH"
        assert "access-control-allow-headers" not in preflight(
            client, "http://a.example", **{"Access-Control-Request-Headers": ""}).headers


def test_a_multi_tenant_default_gives_credentials_only_to_origins_it_names(app_with) -> None:
    """Several tenants (or an operator key) and no cors_credentials: `*` lets any page read answers with the key
    it sends itself, never with what a browser adds on its own (cookies, a proxy's login): no credentials for an
    origin only `*` allows. An origin named (or localhost) is still reflected with credentials."""
    with client_with(app_with, cors_origins=["*", "localhost", "https://app.example.com"]) as client:
        for origin in ("http://evil.example", "web.mydomain.fr", "null"):
            answer = preflight(client, origin)
            assert answer.headers["access-control-allow-origin"] == "*"
            assert "access-control-allow-credentials" not in answer.headers
            simple = client.get("/v1/models", headers={"Origin": origin, **auth()})
            assert simple.headers["access-control-allow-origin"] == "*"
            assert "access-control-allow-credentials" not in simple.headers
        for origin in ("https://app.example.com", "http://localhost:5173"):
            answer = preflight(client, origin)
            assert answer.headers["access-control-allow-origin"] == origin
            assert answer.headers["access-control-allow-credentials"] == "true"


def test_any_origin_without_credentials_is_a_wildcard(app_with) -> None:
    with client_with(app_with, cors_credentials=False) as client:
        answer = preflight(client, "http://app.example.com")
        assert answer.headers["access-control-allow-origin"] == "*"
        assert "access-control-allow-credentials" not in answer.headers
        simple = client.get("/v1/models", headers={"Origin": "http://app.example.com", **auth()})
        assert simple.headers["access-control-allow-origin"] == "*"


def test_localhost_allows_local_origins_only(app_with) -> None:
    with client_with(app_with, cors_origins=["localhost"]) as client:
        for origin in LOCAL:
            answer = preflight(client, origin)
            assert answer.status_code == 200, origin
            assert answer.headers["access-control-allow-origin"] == origin
            assert answer.headers["access-control-allow-credentials"] == "true"
        for origin in NOT_LOCAL:
            answer = preflight(client, origin)  # llama-server's answer: 200, and nothing that lets the browser on
            assert answer.status_code == 200, origin
            assert not any(h.startswith("access-control-") for h in answer.headers), (origin, answer.headers)
            simple = client.get("/v1/models", headers={"Origin": origin, **auth()})
            assert simple.status_code == 200 and "access-control-allow-origin" not in simple.headers
            assert "access-control-allow-credentials" not in simple.headers and "Origin" in simple.headers["vary"]


def test_a_list_of_origins_allows_those_exactly(app_with) -> None:
    with client_with(app_with, cors_origins=["https://app.example.com", "localhost"]) as client:
        assert preflight(client, "https://app.example.com").headers["access-control-allow-origin"] == \
            "https://app.example.com"
        assert preflight(client, "http://localhost:9000").headers["access-control-allow-origin"] == "http://localhost:9000"
        for origin in ("https://app.example.com:8443", "http://app.example.com", "https://example.com", "web.mydomain.fr"):
            assert "access-control-allow-origin" not in preflight(client, origin).headers, origin


def test_no_origins_turns_cors_off(app_with) -> None:
    with client_with(app_with, cors_origins=[]) as client:
        answer = preflight(client, "http://app.example.com")
        assert answer.status_code == 405 and "access-control-allow-origin" not in answer.headers
        assert answer.json()["error"]["code"] == "method_not_allowed"  # the API's own shape
        simple = client.get("/v1/models", headers={"Origin": "http://app.example.com", **auth()})
        assert "access-control-allow-origin" not in simple.headers


@pytest.mark.parametrize("value", ["https://app.example.com/", "app.example.com", "https://app.example.com/ui", ""])
def test_what_is_not_an_origin_is_refused_at_start(app_with, value) -> None:
    with pytest.raises(ConfigError, match="http.cors_origins: .* is not an origin"):
        app_with(cors_origins=[value])


# a real browser: a page of one origin calling the API at another, with credentials and a key


PAGE = """<!doctype html><html><body><pre id="out">pending</pre><script>
const api = "%(api)s", key = "%(key)s";
async function call(path, init) {
  try {
    const r = await fetch(api + path, {credentials: "include", ...init,
                                       headers: {"Authorization": "Bearer " + key, ...(init.headers || {})}});
    return r.status + " " + JSON.stringify(await r.json());
  } catch (e) { return "failed: " + e; }
}
(async () => {
  const models = await call("/v1/models", {});
  const tokens = await call("/tokenize", {method: "POST", headers: {"Content-Type": "application/json"},
                                          body: JSON.stringify({content: "hello"})});
  document.getElementById("out").textContent = JSON.stringify({models, tokens});
})();
</script></body></html>"""


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


browser = pytest.mark.skipif(  # .ci/run installs it; a machine without a browser cannot run these
    chromium() is None, reason="a real browser's fetch needs chromium (Debian: apt-get install -y chromium)")


@contextlib.contextmanager
def page_server(directory) -> Iterator[int]:
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def browse(url: str, profile) -> str:
    """The page's text once its scripts are done (virtual time waits for pending fetches)."""
    command = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
               f"--user-data-dir={profile}", "--virtual-time-budget=20000", "--dump-dom", url]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    return out[out.index('<pre id="out">') + len('<pre id="out">'): out.index("</pre>")]


@browser
@pytest.mark.parametrize("origins, is_allowed", [(["*"], True), (["localhost"], True),
                                                 (["https://app.example.com"], False)])
def test_a_browser_fetches_across_origins_with_credentials(app_with, tmp_path, origins, is_allowed) -> None:
    import json

    app = app_with(cors_origins=origins, cors_credentials=True)  # several tenants: credentials said, not defaulted
    with live_server(app) as api_url, page_server(tmp_path) as page_port:
        (tmp_path / "page.html").write_text(PAGE % {"api": api_url, "key": KEYS["t1"]})
        text = browse(f"http://127.0.0.1:{page_port}/page.html", tmp_path / "profile")
    assert text != "pending", "the page's script did not finish"
    results = json.loads(text.replace("&amp;", "&").replace("&lt;", "<").replace("&gt;", ">").replace("&quot;", '"'))
    if is_allowed:
        status, body = results["models"].split(" ", 1)
        assert status == "200" and json.loads(body)["data"][0]["id"] == "tiny"
        status, body = results["tokens"].split(" ", 1)
        assert status == "200" and json.loads(body)["tokens"]
    else:  # the browser itself refuses to hand the answers over
        assert results["models"].startswith("failed: TypeError") and results["tokens"].startswith("failed: TypeError")
