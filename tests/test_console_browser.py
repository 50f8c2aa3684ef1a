"""The console in a real browser: Debian's chromium driven by Playwright (never a
browser download). Signs in through the form, loads every page against a store the test
fills, checks what each shows (the charts drawn from their data, under the console's
Content-Security-Policy, with no script error), and saves a screenshot of each page:
to $TENSORDB_CONSOLE_SHOTS when set (docs/images/console-*.png come from there), else
to the test's temporary folder. Skips, saying why, where chromium or Playwright is
missing (``apt-get install chromium``; Playwright is in the test extra)."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from test_console import NODE_TOKEN, fill

import tensordb
import transport
from tensordb.catalog import TokenStore
from tensordb.console import ConsoleServer, serve_console
from tensordb.errors import NotFound

sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright is not installed "
                               "(pip install -e '.[test]')")
CHROMIUM = os.environ.get("CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
if not os.path.exists(CHROMIUM):
    pytest.skip(f"no chromium at {CHROMIUM} (apt-get install chromium)",
                allow_module_level=True)

# what a headless chromium needs in a container, and nothing that reaches the network
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic",
        "--no-first-run", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--disable-extensions"]


@pytest.fixture
def console(sqlite_db: tensordb.Database) -> Iterator[tuple[ConsoleServer, dict[str, Any]]]:
    got = {**fill(sqlite_db), "db": sqlite_db}
    kv = got["kv"]
    keys = kv.keys(list(range(1000, 1000 + 16 * 32)))
    auth = transport.Authenticator(NODE_TOKEN, TokenStore(sqlite_db.catalog.engine))
    c = serve_console(sqlite_db, 0, auth=auth, sample_interval=0.2)
    # KV traffic over several samples: the occupancy climbs (blocks of 256 KiB in an
    # arena of 16 MiB), each interval has r hits and one miss
    for r in range(1, 7):
        kv.put(keys[:5 * r], [torch.full((65536,), float(i)) for i in range(5 * r)])
        kv.get(keys[:r])
        with pytest.raises(NotFound):
            kv.get(keys[5 * r:5 * r + 1])
        c.series.sample()  # at least one point a round, however the host is loaded
        time.sleep(0.25)
    c.series.sample()
    yield c, got
    c.close()
    kv.close()


@pytest.fixture
def shots(tmp_path: Path) -> Path:
    out = Path(os.environ.get("TENSORDB_CONSOLE_SHOTS") or tmp_path / "shots")
    out.mkdir(parents=True, exist_ok=True)
    return out


def _drawn(page: Any, selector: str) -> int:
    """How many of the canvas's pixels are not blank: a chart was drawn on it."""
    return int(page.locator(selector).first.evaluate(
        "c => { const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;"
        " let n = 0; for (let i = 3; i < d.length; i += 4) if (d[i]) n++; return n; }"))


def test_every_page_in_a_browser(console: tuple[ConsoleServer, dict[str, Any]],
                                 shots: Path) -> None:
    c, got = console
    errors: list[str] = []
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            page = browser.new_context(viewport={"width": 1280, "height": 820}).new_page()
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("console", lambda m: errors.append(m.text) if m.type == "error"
                    and not m.text.startswith("Failed to load resource") else None)
            failed: list[tuple[int, str]] = []
            page.on("response", lambda r: failed.append((r.status, r.url.split("?")[0]))
                    if r.status >= 400 else None)

            # sign in through the form: a page asked for first comes back after it
            page.goto(c.url + "/kv")
            assert page.url.startswith(c.url + "/login")
            page.fill("input[name=token]", "tdb_not_a_token")
            page.click("button[type=submit]")
            assert page.locator("#login-failed").is_visible()
            page.fill("input[name=token]", NODE_TOKEN)
            page.click("button[type=submit]")
            page.wait_for_url(c.url + "/kv")

            page.wait_for_selector("body[data-charts-ready='1']")
            ns = page.locator("section.kv[data-namespace='team-a/kv']")
            counters, _ = got["db"].kv_counters("team-a/kv") or ({}, 0)
            assert ns.locator(".host-blocks").inner_text() == str(counters["host_blocks"])
            assert ns.locator(".misses").inner_text() == str(counters["misses"]) != "0"
            for kind in ("hit_rate", "occupancy"):
                canvas = f"canvas.kv-chart[data-kind={kind}]"
                assert int(page.locator(canvas).get_attribute("data-points") or 0) >= 5
                assert _drawn(page, canvas) > 500, kind
            page.screenshot(path=shots / "console-kv.png", full_page=True)

            page.goto(c.url + "/collections")
            rows = page.locator("#collections tbody tr")
            assert rows.count() == 2
            llama = page.locator("#collections tr[data-name='team-a/llama'] td")
            assert llama.nth(1).inner_text() == "3" and llama.nth(8).inner_text() == "ckpt-300@3"
            page.screenshot(path=shots / "console-collections.png", full_page=True)

            page.click("text=team-a/llama")
            page.wait_for_selector("body[data-charts-ready='1']")
            assert page.locator("#history tbody tr").count() == 3
            assert page.locator("#history tr[data-version='3'] .tags").inner_text() == "ckpt-300"
            assert _drawn(page, "#bytes-chart") > 500
            # a message is shown as text, not markup
            assert page.locator("#history b").count() == 0
            assert "step 200 <b>bold</b>" in page.locator("#history").inner_text()
            page.screenshot(path=shots / "console-collection.png", full_page=True)

            page.click("#history tr[data-version='2'] a")
            assert page.locator("#tensors tbody tr").count() == 4
            assert page.locator("#summary").inner_text().startswith("4 tensors, 64.0 KiB")
            page.screenshot(path=shots / "console-version.png", full_page=True)

            page.click("nav >> text=Tiers")
            assert page.locator("#tier-use tbody tr").count() >= 1
            assert page.locator("#local-tiers tr[data-tier=host]").count() == 1
            page.screenshot(path=shots / "console-tiers.png", full_page=True)

            page.click("nav >> text=Nodes")
            assert page.locator("#replication tr[data-collection='team-a/llama'] .held"
                                ).first.inner_text() == "100.0 %"
            page.screenshot(path=shots / "console-nodes.png", full_page=True)

            page.click("nav >> text=Policies")
            assert page.locator("#policies tr[data-policy=tick] .outcome").inner_text() == "ok"
            page.screenshot(path=shots / "console-policies.png", full_page=True)

            page.click("nav >> text=Query")
            page.fill("textarea[name=q]", "SELECT collection, count(*) AS n, sum(nbytes) AS "
                      "nbytes FROM tensors GROUP BY collection ORDER BY collection")
            page.click("form.query button")
            assert page.locator("#result tbody tr").count() == 2
            assert page.locator("#result tbody tr").first.inner_text().split("\t")[:2] == \
                ["team-a/llama", "4"]
            page.screenshot(path=shots / "console-query.png", full_page=True)
            page.fill("textarea[name=q]", "EVICT COLLECTION 'team-a/llama' FROM TIER host")
            page.click("form.query button")
            assert "read statements only" in page.locator("#error").inner_text()
            # the two refusals asked for, and no other resource failed (a chart library
            # or a style blocked by the policy would be here)
            assert failed == [(401, c.url + "/login"), (400, c.url + "/query")]
        finally:
            browser.close()
    assert errors == []
    assert sorted(f.name for f in shots.glob("console-*.png")) == sorted(
        f"console-{n}.png" for n in ("kv", "collections", "collection", "version", "tiers",
                                     "nodes", "policies", "query"))
