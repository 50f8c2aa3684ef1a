"""The web console: each page against a store the test fills (what it shows, exactly),
the token's scope (a tenant sees its names only; node-wide pages are withheld), the
sign-in and its session, the query box's refusal of anything but read statements (the
store unchanged), bad inputs, the KV series, and the two CLI commands that serve it.
The browser test is tests/test_console_browser.py."""

from __future__ import annotations

import hashlib
import http.client
import http.cookiejar
import json
import re
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from sqlalchemy import event

import query
import tensordb
import transport
from tensordb.catalog import TokenStore
from tensordb.console import SESSION_COOKIE, ConsoleServer, KVSeries, serve_console
from tensordb.errors import InvalidInput, NotFound

NODE_TOKEN = "console-node-token-0123456789"
STATIC = Path(tensordb.__file__).parent / "console" / "static"
Store = tuple[tensordb.Database, dict[str, Any]]  # the filled store and what fill() made


def fill(db: tensordb.Database) -> dict[str, Any]:
    """Two tenants' collections (three versions of one, a tag), a KV namespace with
    hits and misses, a policy with a run."""
    base = {f"layers.{i}.w": torch.full((64, 64), float(i)) for i in range(4)}
    db.commit("team-a/llama", base, message="step 100")
    base["layers.0.w"] = torch.full((64, 64), 10.0)
    db.commit("team-a/llama", base, message="step 200 <b>bold</b>")
    base["layers.1.w"] = torch.full((64, 64), 11.0)
    db.commit("team-a/llama", base, message="step 300")
    db.tag("team-a/llama", "ckpt-300")
    db.commit("team-b/secret", {"t": torch.arange(10)})
    kv = db.kv("team-a/kv", block_tokens=16, capacity_bytes=16 << 20)
    keys = kv.keys(list(range(16 * 8)))
    kv.put(keys[:4], [torch.full((1024,), float(i)) for i in range(4)])
    kv.get(keys[:4])
    kv.match(keys)
    db.query("CREATE POLICY tick EVERY '1 hour' DO SELECT count(*) AS n FROM collections")
    query.PolicyRunner(db).run_now("tick")
    return {"kv": kv, "keys": keys}


@pytest.fixture
def store(sqlite_db: tensordb.Database) -> Iterator[Store]:
    got = fill(sqlite_db)
    yield sqlite_db, got
    got["kv"].close()


@pytest.fixture
def console(store: Store) -> Iterator[ConsoleServer]:
    db, _ = store
    auth = transport.Authenticator(NODE_TOKEN, TokenStore(db.catalog.engine), ttl=0.0)
    c = serve_console(db, 0, auth=auth, sample_interval=60.0)
    yield c
    c.close()


def fetch(c: ConsoleServer, path: str, token: str | None = NODE_TOKEN,
          opener: urllib.request.OpenerDirector | None = None,
          data: bytes | None = None) -> tuple[int, str, Any]:
    req = urllib.request.Request(c.url + path, data=data)
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    op = opener or urllib.request.build_opener(_NoRedirect)
    try:
        with op.open(req, timeout=30) as r:
            return r.status, r.read().decode(), r.headers
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.read().decode(), e.headers


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kw: Any) -> None:
        return None


def cells(html: str, table_id: str) -> list[list[str]]:
    """The text of each body row's cells of table ``table_id``."""
    m = re.search(rf'<table id="{table_id}".*?<tbody>(.*?)</tbody>', html, re.S)
    assert m, f"no table {table_id}"
    rows = re.findall(r"<tr[^>]*>(.*?)</tr>", m.group(1), re.S)
    return [[re.sub(r"<[^>]+>", "", c).strip() for c in re.findall(r"<td[^>]*>(.*?)</td>", r, re.S)]
            for r in rows]


def titles(html: str, table_id: str, cls: str) -> list[int]:
    """The exact byte counts (title attributes) of the cells of class ``cls``."""
    m = re.search(rf'<table id="{table_id}".*?</table>', html, re.S)
    assert m
    return [int(x) for x in re.findall(rf'class="n {cls}" title="(\d+) bytes"', m.group(0))]


# -- the pages -------------------------------------------------------------------------
def test_collections_page_lists_heads_versions_and_bytes_stored_against_shared(
        console: ConsoleServer, store: Store) -> None:
    db, _ = store
    status, html, _ = fetch(console, "/collections")
    assert status == 200
    rows = {r[0]: r for r in cells(html, "collections")}
    assert set(rows) == {"team-a/llama", "team-b/secret"}
    assert rows["team-a/llama"][1:3] == ["3", "4"] and rows["team-a/llama"][4] == "3"
    assert rows["team-a/llama"][8] == "ckpt-300@3"
    one = 64 * 64 * 4
    # three versions of 4 tensors; v1 stored 4 extents, v2 and v3 one each
    assert titles(html, "collections", "logical") == [12 * one, 10 * 8]
    small = db.query("SELECT sum(nbytes) AS n FROM extents WHERE collection = 'team-b/secret'"
                     ).column("n")[0].as_py()
    assert small >= 10 * 8  # one segment, aligned: what the store holds for it
    assert titles(html, "collections", "stored") == [6 * one, small]
    assert titles(html, "collections", "saved") == [6 * one, 0]
    assert [q.used_bytes for q in (db.set_quota("team-a/*", 1 << 30), db.quotas())[1]] \
        == [6 * one]  # the figure quotas count


def test_collection_page_is_its_history_with_tags_and_the_chart_data(
        console: ConsoleServer) -> None:
    status, html, _ = fetch(console, "/collection?name=" + urllib.parse.quote("team-a/llama"))
    assert status == 200
    rows = cells(html, "history")
    assert [r[0] for r in rows] == ["3", "2", "1"]
    assert rows[0][1] == "ckpt-300" and rows[2][2] == "step 100"
    one = 64 * 64 * 4
    assert titles(html, "history", "written") == [one, one, 4 * one]
    assert titles(html, "history", "shared") == [3 * one, 3 * one, 0]
    # a message is text, never markup
    assert "step 200 &lt;b&gt;bold&lt;/b&gt;" in html and "<b>bold</b>" not in html
    chart = re.search(r'<canvas id="bytes-chart"[^>]*>', html, re.S)
    assert chart and "data-written=\"[16384, 16384, 65536]\"" in chart.group(0)


def test_version_page_lists_its_tensors_and_pages_through_them(
        console: ConsoleServer, store: Store) -> None:
    db, _ = store
    status, html, _ = fetch(console, "/version?name=team-a%2Fllama&v=1")
    assert status == 200
    rows = cells(html, "tensors")
    assert [r[0] for r in rows] == [f"layers.{i}.w" for i in range(4)]
    assert rows[0][1:4] == ["float32", "(64, 64)", "16384"]
    assert rows[0][4] == "host" and rows[0][5] == db.config.node
    with db.snapshot("team-a/llama", version=1) as snap:
        info = snap.info()
    assert {r[0]: int(r[3]) for r in rows} == {k: v[2] for k, v in info.items()}
    # v1's layers.0.w was replaced in v2: v2 shows the new row's checksum
    v2 = cells(fetch(console, "/version?name=team-a%2Fllama&v=2")[1], "tensors")
    assert v2[0][6] != rows[0][6] and v2[1][6] == rows[1][6]
    # one page: offset past the first rows
    _, page2, _ = fetch(console, "/version?name=team-a%2Fllama&v=1&offset=2")
    assert [r[0] for r in cells(page2, "tensors")] == ["layers.2.w", "layers.3.w"]


def test_tiers_page_shows_each_node_and_tier(console: ConsoleServer,
                                             store: Store
                                             ) -> None:
    db, _ = store
    status, html, _ = fetch(console, "/tiers")
    assert status == 200
    use = cells(html, "tier-use")
    got = db.query("SELECT node, tier, sum(nbytes) AS n FROM extents GROUP BY node, tier"
                   ).to_pylist()
    assert [(r[0], r[1]) for r in use] == [(g["node"], g["tier"]) for g in got]
    local = {r[0]: r for r in cells(html, "local-tiers")}
    assert set(local) == {"host", "disk"}
    st = db.stats()
    assert f'title="{st["host_bytes"]} bytes"' in html
    per = cells(html, "collection-tiers")
    assert {r[0] for r in per} == {"team-a/llama", "team-b/secret"}
    assert 'id="no-quotas"' in html
    db.set_quota("team-a/*", 1 << 20)
    _, html, _ = fetch(console, "/tiers")
    quota = cells(html, "quotas")
    assert quota[0][0] == "team-a/*" and quota[0][1] == "1.0 MiB"
    assert f'class="n stored" title="{db.quotas()[0].used_bytes} bytes"' in html


def test_kv_page_shows_the_shared_counters(console: ConsoleServer,
                                           store: Store
                                           ) -> None:
    db, got = store
    status, html, _ = fetch(console, "/kv")
    assert status == 200
    c, capacity = db.kv_counters("team-a/kv") or ({}, 0)
    assert c["hits"] == 4 and c["host_blocks"] == 4
    section = re.search(r'<section class="kv" data-namespace="team-a/kv">(.*?)</section>',
                        html, re.S)
    assert section
    text = section.group(1)
    assert f'<td class="hits">{c["hits"]}</td>' in text
    assert f'<td class="misses">{c["misses"]}</td>' in text
    assert '<td class="host-blocks">4</td>' in text
    rate = c["hits"] / (c["hits"] + c["misses"])
    assert f'<td class="hit-rate">{100 * rate:.1f} %</td>' in text
    assert text.count('class="kv-chart"') == 2


def test_kv_series_is_the_hit_rate_of_each_interval_and_the_occupancy(
        store: Store) -> None:
    db, got = store
    kv, keys = got["kv"], got["keys"]
    series = KVSeries(db, interval=60.0)
    series.sample()
    kv.get(keys[:2])                       # 2 hits
    with pytest.raises(NotFound):
        kv.get(keys[6:8])                  # a miss
    series.sample()
    series.sample()                        # nothing looked up in between
    s = series.series("team-a/kv")
    assert len(s["t"]) == 3 and s["t"] == sorted(s["t"])
    c, capacity = db.kv_counters("team-a/kv") or ({}, 0)
    assert s["hit_rate"][0] is None and s["hit_rate"][2] is None
    assert 0 < s["hit_rate"][1] < 1
    assert s["occupancy"][-1] == pytest.approx(c["host_bytes"] / capacity)
    assert series.series("no-such") == {"t": [], "hit_rate": [], "occupancy": [],
                                        "host_bytes": [], "disk_bytes": []}
    with pytest.raises(InvalidInput):
        KVSeries(db, interval=0)


def test_api_kv_gives_the_series_in_scope(console: ConsoleServer) -> None:
    status, body, _ = fetch(console, "/api/kv?name=team-a%2Fkv")
    assert status == 200
    got = json.loads(body)
    assert got["name"] == "team-a/kv" and len(got["t"]) >= 1
    assert len(got["hit_rate"]) == len(got["occupancy"]) == len(got["t"])
    assert fetch(console, "/api/kv")[0] == 400


def test_nodes_page_shows_what_each_node_holds(console: ConsoleServer,
                                               store: Store
                                               ) -> None:
    db, _ = store
    status, html, _ = fetch(console, "/nodes")
    assert status == 200
    assert 'id="no-nodes"' in html  # an embedded store: no node server registered
    rows = {r[0]: r for r in cells(html, "replication")}
    version, total, held = db.holdings("team-a/llama")
    assert rows["team-a/llama"][1] == "3" and held == {db.config.node: total}
    assert rows["team-a/llama"][3] == "100.0 %"


def test_policies_page_shows_each_policy_and_its_last_run(console: ConsoleServer) -> None:
    status, html, _ = fetch(console, "/policies")
    assert status == 200
    rows = cells(html, "policies")
    assert rows[0][0] == "tick" and rows[0][1] == "every" and rows[0][5] == "1"
    assert rows[0][7] == "ok"
    assert cells(html, "runs")[0][0] == "tick"


def test_query_box_runs_read_statements(console: ConsoleServer) -> None:
    q = urllib.parse.quote("SELECT collection, count(*) AS n FROM tensors GROUP BY "
                           "collection ORDER BY collection")
    status, html, _ = fetch(console, f"/query?q={q}")
    assert status == 200
    assert cells(html, "result") == [["team-a/llama", "4"], ["team-b/secret", "1"]]
    assert fetch(console, "/query?q=" + urllib.parse.quote("SHOW POLICIES"))[0] == 200
    assert fetch(console, "/query?q=" + urllib.parse.quote(
        "EXPLAIN SELECT name FROM tensors"))[0] == 200


@pytest.mark.parametrize("statement", [
    "EVICT COLLECTION 'team-a/llama' FROM TIER host",
    "PIN COLLECTION 'team-a/llama'",
    "UNPIN COLLECTION 'team-a/llama'",
    "DROP VERSIONS OF 'team-a/llama' KEEP LAST 1",
    "CREATE POLICY evil EVERY '1 hour' DO EVICT COLLECTION 'team-a/llama' FROM TIER host",
    "DROP POLICY tick",
    "SNAPSHOT 'team-a/llama' AS TAG 'x'",
    "REPLICATE 'team-a/llama' TO NODE 'n2'",
])
def test_query_box_refuses_every_statement_that_is_not_a_read(
        console: ConsoleServer, store: Store,
        statement: str) -> None:
    db, _ = store

    def state() -> object:
        stats = {k: v for k, v in db.stats().items() if not k.startswith("scrub")}
        return (db.history("team-a/llama"), db.tags("team-a/llama"), db.pins(),
                db.query("SHOW POLICIES").to_pylist(), stats,
                db.query("SELECT * FROM extents").to_pylist())

    before = state()
    assert query.parse(statement).kind not in ("SELECT", "EXPLAIN", "SHOW POLICIES")
    status, html, _ = fetch(console, "/query?q=" + urllib.parse.quote(statement))
    assert status == 400
    m = re.search(r'<p class="error" id="error"><b>(\w+)</b>: (.*?)</p>', html, re.S)
    assert m, html
    assert m.group(1) == "InvalidInput" and "read statements only" in m.group(2)
    after = state()
    assert after == before


def test_bad_inputs_are_typed_errors_and_change_nothing(
        console: ConsoleServer, store: Store) -> None:
    db, _ = store
    before = db.query("SELECT * FROM commits").to_pylist()
    cases = {
        "/version?name=team-a%2Fllama&v=x": (400, "InvalidInput"),
        "/version?name=team-a%2Fllama&v=1&offset=-1": (400, "InvalidInput"),
        "/version?name=team-a%2Fllama&v=99": (404, "NotFound"),
        "/version?v=1": (400, "InvalidInput"),
        "/collection?name=nope": (404, "NotFound"),
        "/collection": (400, "InvalidInput"),
        "/query?q=SELEC": (400, "QueryError"),
        "/query?q=" + "x" * 10_001: (400, "InvalidInput"),
    }
    for path, (code, kind) in cases.items():
        status, html, _ = fetch(console, path)
        assert status == code, path
        assert f"<h1>{kind}</h1>" in html or f"<b>{kind}</b>" in html, path
    assert db.query("SELECT * FROM commits").to_pylist() == before


# -- tokens and sessions ---------------------------------------------------------------
def test_a_scoped_token_sees_its_tenant_only(console: ConsoleServer,
                                             store: Store
                                             ) -> None:
    db, _ = store
    _, token = TokenStore(db.catalog.engine).create("read", "team-a/*")
    _, html, _ = fetch(console, "/collections", token)
    assert [r[0] for r in cells(html, "collections")] == ["team-a/llama"]
    assert "team-b" not in html
    # another tenant's collection is as absent as one that does not exist
    assert fetch(console, "/collection?name=team-b%2Fsecret", token)[0] == 404
    assert fetch(console, "/version?name=team-b%2Fsecret&v=1", token)[0] == 404
    # node-wide figures, policies and the query box need every name in scope
    for path in ("/tiers", "/nodes", "/policies", "/query?q=SELECT+name+FROM+tensors"):
        status, html, _ = fetch(console, path, token)
        assert status == 200 and 'id="withheld"' in html, path
        assert "team-b" not in html, path
    _, tiers, _ = fetch(console, "/tiers", token)
    assert 'id="tier-use"' not in tiers and {r[0] for r in cells(tiers, "collection-tiers")} \
        == {"team-a/llama"}
    assert fetch(console, "/api/kv?name=team-a%2Fkv", token)[0] == 200
    _, other = TokenStore(db.catalog.engine).create("read", "team-b/*")
    assert fetch(console, "/api/kv?name=team-a%2Fkv", other)[0] == 404
    _, kvpage, _ = fetch(console, "/kv", other)
    assert "team-a/kv" not in kvpage and 'id="empty"' in kvpage


def test_without_a_token_pages_send_to_sign_in_and_the_api_is_401(
        console: ConsoleServer) -> None:
    status, _, headers = fetch(console, "/collections", None)
    assert status == 303 and headers["location"] == "/login?next=/collections"
    status, body, headers = fetch(console, "/api/kv?name=team-a%2Fkv", None)
    assert status == 401 and json.loads(body)["error"] == "Unauthorized"
    assert fetch(console, "/collections", "wrong-token-0123456789")[0] == 303
    assert fetch(console, "/login", None)[0] == 200
    assert fetch(console, "/static/console.css", None)[0] == 200


def test_sign_in_keeps_the_token_server_side_and_a_revoked_token_ends_the_session(
        console: ConsoleServer, store: Store) -> None:
    db, _ = store
    tokens = TokenStore(db.catalog.engine)
    token_id, token = tokens.create("read", "*")
    jar = http.cookiejar.CookieJar()
    browser = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar), _NoRedirect)
    bad = urllib.parse.urlencode({"token": "tdb_wrong", "next": "/kv"}).encode()
    status, html, _ = fetch(console, "/login", None, browser, bad)
    assert status == 401 and 'id="login-failed"' in html and not list(jar)
    form = urllib.parse.urlencode({"token": token, "next": "/kv"}).encode()
    status, _, headers = fetch(console, "/login", None, browser, form)
    assert status == 303 and headers["location"] == "/kv"
    cookie = headers["set-cookie"]
    assert f"{SESSION_COOKIE}=" in cookie and "HttpOnly" in cookie
    assert "SameSite=strict" in cookie or "samesite=strict" in cookie.lower()
    assert token not in cookie and token[4:] not in cookie
    assert fetch(console, "/kv", None, browser)[0] == 200
    tokens.revoke(token_id)  # the console's Authenticator caches nothing (ttl=0)
    assert fetch(console, "/kv", None, browser)[0] == 303
    # the printed link's form, ?token=, signs in too
    status, _, headers = fetch(console, f"/login?token={NODE_TOKEN}&next=/tiers", None,
                               browser)
    assert status == 303 and headers["location"] == "/tiers"
    assert fetch(console, "/logout", None, browser)[0] == 303
    assert fetch(console, "/tiers", None, browser)[0] == 303


@pytest.mark.parametrize("target", ["//evil.example/x", "https://evil.example/", "evil",
                                    "/\\evil.example"])
def test_sign_in_never_redirects_off_the_console(console: ConsoleServer, target: str) -> None:
    q = urllib.parse.urlencode({"token": NODE_TOKEN, "next": target})
    status, _, headers = fetch(console, f"/login?{q}", None)
    assert status == 303 and headers["location"] == "/"


def test_every_answer_carries_the_security_headers(console: ConsoleServer) -> None:
    for path in ("/collections", "/login", "/static/console.js", "/api/kv?name=team-a%2Fkv"):
        _, _, headers = fetch(console, path)
        assert "script-src" not in headers["content-security-policy"]  # default-src 'self'
        assert headers["content-security-policy"].startswith("default-src 'self'")
        assert headers["x-content-type-options"] == "nosniff"
        assert headers["referrer-policy"] == "no-referrer"


def test_a_console_off_loopback_needs_a_token(sqlite_db: tensordb.Database) -> None:
    with pytest.raises(InvalidInput, match="without a token"):
        serve_console(sqlite_db, 0, "0.0.0.0")
    with pytest.raises(InvalidInput):
        serve_console(sqlite_db, 70000)


def test_a_console_without_tokens_on_loopback_opens_to_anyone(sqlite_db: tensordb.Database
                                                               ) -> None:
    sqlite_db.commit("m", {"a": torch.ones(2)})
    c = serve_console(sqlite_db, 0)
    try:
        status, html, _ = fetch(c, "/collections", None)
        assert status == 200 and [r[0] for r in cells(html, "collections")] == ["m"]
    finally:
        c.close()


def test_the_vendored_chart_library_is_the_one_named(tmp_path: Path) -> None:
    vendored = (STATIC / "VENDORED").read_text()
    want = re.search(r"sha256 ([0-9a-f]{64})", vendored)
    assert want and "Chart.js 4.6.1" in vendored
    got = hashlib.sha256((STATIC / "chart.umd.min.js").read_bytes()).hexdigest()
    assert got == want.group(1)
    assert (STATIC / "chart.umd.min.js").read_text().startswith("/*!\n * Chart.js v4.6.1")


def test_a_console_without_tokens_answers_only_its_own_names(sqlite_db: tensordb.Database
                                                              ) -> None:
    """DNS rebinding: another site's name pointed at 127.0.0.1 reaches nothing."""
    c = serve_console(sqlite_db, 0)
    try:
        for host, code in (("evil.example", 400), ("localhost", 200), ("127.0.0.1", 200)):
            conn = http.client.HTTPConnection("127.0.0.1", c.port, timeout=30)
            conn.request("GET", "/collections", headers={"Host": f"{host}:{c.port}"})
            r = conn.getresponse()
            r.read()
            conn.close()
            assert r.status == code, host
    finally:
        c.close()


def test_two_authorization_headers_open_nothing(console: ConsoleServer) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", console.port, timeout=30)
    conn.putrequest("GET", "/collections")
    conn.putheader("Authorization", f"Bearer {NODE_TOKEN}")
    conn.putheader("Authorization", f"Bearer {NODE_TOKEN}")
    conn.endheaders()
    r = conn.getresponse()
    r.read()
    conn.close()
    assert r.status == 303 and r.headers["location"].startswith("/login")


def test_the_query_box_reads_one_row_past_what_it_shows(sqlite_db: tensordb.Database
                                                        ) -> None:
    from tensordb.console._data import QUERY_ROWS

    sqlite_db.commit("many", {f"t{i:05d}": torch.ones(1) for i in range(QUERY_ROWS + 50)})
    seen: list[tuple[str, Any]] = []

    def spy(conn: Any, cursor: Any, statement: str, params: Any, *a: Any) -> None:
        seen.append((statement, params))

    event.listen(sqlite_db.catalog.engine, "before_cursor_execute", spy)
    c = serve_console(sqlite_db, 0)
    try:
        q = urllib.parse.quote("SELECT name FROM tensors ORDER BY name")
        status, html, _ = fetch(c, f"/query?q={q}", None)
        assert status == 200 and len(cells(html, "result")) == QUERY_ROWS
        assert f"more than {QUERY_ROWS} rows" in html
        selects = [(s, p) for s, p in seen if "FROM tensors" in s]
        assert selects and all("LIMIT" in s for s, _ in selects)
        assert QUERY_ROWS + 1 in tuple(selects[-1][1])
        # a smaller LIMIT of the statement's own is kept
        status, html, _ = fetch(c, "/query?q=" + urllib.parse.quote(
            "SELECT name FROM tensors ORDER BY name LIMIT 3"), None)
        assert len(cells(html, "result")) == 3 and "3 rows" in html
    finally:
        c.close()
        event.remove(sqlite_db.catalog.engine, "before_cursor_execute", spy)


def test_paging_past_a_versions_last_tensor_is_not_found(console: ConsoleServer) -> None:
    assert fetch(console, "/version?name=team-a%2Fllama&v=1&offset=4")[0] == 404
    assert fetch(console, "/version?name=team-a%2Fllama&v=1&offset=1000")[0] == 404
    assert fetch(console, "/version?name=team-a%2Fllama&v=1&offset=3")[0] == 200


def test_a_damaged_kv_namespace_is_shown_damaged_and_the_rest_still_served(
        console: ConsoleServer, store: Store) -> None:
    db, _ = store
    kv = db.kv("team-a/broken", block_tokens=16, capacity_bytes=8 << 20)
    kv.put(kv.keys(list(range(16))), [torch.ones(8)])
    kv.close()
    shm = Path(db.config.shm_dir) / "kv"
    before = {p.parent for p in shm.glob("*/index.kvx")}
    c, _ = db.kv_counters("team-a/kv") or ({}, 0)
    index = next(p for p in shm.glob("*/index.kvx") if "broken" in p.parent.name)
    with open(index, "r+b") as f:
        f.truncate(16)
    with pytest.raises(tensordb.errors.CorruptData):
        db.kv_counters("team-a/broken")
    status, html, _ = fetch(console, "/kv")
    assert status == 200
    broken = re.search(r'data-namespace="team-a/broken">(.*?)</section>', html, re.S)
    assert broken and 'class="error damaged"' in broken.group(1)
    ok = re.search(r'data-namespace="team-a/kv">(.*?)</section>', html, re.S)
    assert ok and f'<td class="hits">{c["hits"]}</td>' in ok.group(1)
    console.series.sample()  # the sampler skips it and samples the rest
    assert len(console.series.series("team-a/kv")["t"]) >= 2
    assert {p.parent for p in shm.glob("*/index.kvx")} == before


def test_a_console_over_tls_speaks_https_only_with_a_secure_cookie(
        store: Store, tmp_path: Path) -> None:
    trustme = pytest.importorskip("trustme")
    import ssl

    db, _ = store
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.private_key_pem.write_to_path(str(key_path))
    with open(cert_path, "wb") as f:
        for blob in cert.cert_chain_pems:
            f.write(blob.bytes())
    tls = transport.ServerTLS.load(cert_path, key_path)
    auth = transport.Authenticator(NODE_TOKEN, TokenStore(db.catalog.engine))
    c = serve_console(db, 0, auth=auth, tls=tls.context())
    try:
        assert c.url.startswith("https://")
        trusting = ssl.create_default_context()
        ca.configure_trust(trusting)
        op = urllib.request.build_opener(urllib.request.HTTPSHandler(context=trusting),
                                         _NoRedirect)
        status, _, headers = fetch(c, f"/login?token={NODE_TOKEN}", None, op)
        assert status == 303 and "Secure" in headers["set-cookie"]
        assert fetch(c, "/collections", NODE_TOKEN, op)[0] == 200
        # clear text is refused: the handshake is all the port speaks
        with pytest.raises((urllib.error.URLError, ConnectionError, http.client.HTTPException)):
            urllib.request.urlopen(c.url.replace("https", "http") + "/login", timeout=10)
    finally:
        c.close()


# -- the CLI ---------------------------------------------------------------------------
def _serve(args: list[str]) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    p = subprocess.Popen([sys.executable, "-m", "tensordb.cli", *args],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout is not None
    line = p.stdout.readline()
    if not line:
        p.wait(10)
        raise AssertionError(p.stderr.read() if p.stderr else "no output")
    return p, json.loads(line)


def _stop(p: subprocess.Popen[str]) -> None:
    p.terminate()
    try:
        p.wait(20)
    finally:
        for f in (p.stdout, p.stderr):
            if f is not None:
                f.close()


def test_tensordb_console_prints_a_sign_in_url(home: Path) -> None:
    with tensordb.connect(home=home) as db:
        db.commit("llama", {"a": torch.ones(4)})
    p, line = _serve(["console", "--home", str(home), "--port", "0"])
    try:
        url = line["url"]
        assert url.startswith(f"http://127.0.0.1:{line['console_port']}/login?token=tdbc_")
        jar = http.cookiejar.CookieJar()
        browser = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
        with browser.open(url, timeout=30) as r:  # signs in, then lands on the collections
            html = r.read().decode()
        assert r.url.endswith("/collections") and "llama" in html
        anon = urllib.request.build_opener(_NoRedirect)
        with pytest.raises(urllib.error.HTTPError) as e:
            anon.open(url.split("/login")[0] + "/collections", timeout=30)
        assert e.value.code == 303
        e.value.close()
    finally:
        _stop(p)


def test_tensordb_serve_serves_the_console_behind_the_node_token(home: Path) -> None:
    with tensordb.connect(home=home) as db:
        db.commit("llama", {"a": torch.ones(4)})
    p, line = _serve(["--home", str(home), "serve", "--port", "0", "--token", NODE_TOKEN,
                      "--console-port", "0"])
    try:
        port = line["console_port"]
        assert isinstance(port, int) and port > 0
        req = urllib.request.Request(f"http://127.0.0.1:{port}/nodes",
                                     headers={"Authorization": f"Bearer {NODE_TOKEN}"})
        with urllib.request.urlopen(req, timeout=30) as r:
            html = r.read().decode()
        rows = {row[0]: row for row in cells(html, "nodes")}
        assert rows[line["node"]][2] == "up"
        anon = urllib.request.build_opener(_NoRedirect)
        with pytest.raises(urllib.error.HTTPError) as e:
            anon.open(f"http://127.0.0.1:{port}/collections", timeout=30)
        assert e.value.code == 303
        e.value.close()
    finally:
        _stop(p)
