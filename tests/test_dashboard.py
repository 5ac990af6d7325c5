"""The live dashboard of a real `pagedkv serve`, in a real browser (Debian's chromium, Playwright).

One server process (the real model, a small pool) for the whole module. The browser reads the
canvas back pixel by pixel: the test checks what is drawn, not what the page's code believes.
Artifacts (a screenshot, the server log) go to test-artifacts/ (gitignored).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from pagedkv.cache.block_map import unrle
from pagedkv.plot import CACHED_RGB, FREE_RGB, OWNED_PALETTE, SHARED_MAX, shared_rgb
from pagedkv.server import ServerThread, build_app
from pagedkv.server.dashboard import COLORS

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run"]
KEY = "dashboard-test-key"
NUM_BLOCKS = 192  # room for every prompt and MAX_TOKENS without preemption
MAX_TOKENS = 400
SHARED = {shared_rgb(r) for r in range(2, SHARED_MAX + 1)}
PROMPTS = ["Name a quokka habit.", "Tell me about zebras.", "Describe the moon briefly.",
           "What is a paged KV cache?", "List two rivers.", "Write one line about rain."]
ALLOWED_KEYS = {"num_blocks", "block_size", "state_names", "counts", "summary", "states", "refs",
                "owner", "owners", "engine", "time"}

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    """A real `pagedkv serve` on loopback with an API key; yields its base URL."""
    ARTIFACTS.mkdir(exist_ok=True)
    port = _free_port()
    log = open(ARTIFACTS / "dashboard-serve.log", "w")  # noqa: SIM115
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagedkv.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
         "--api-key", KEY, "--num-blocks", str(NUM_BLOCKS), "--max-num-seqs", "8",
         "--threads", "2", "--log-level", "warning"],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            log.close()
            pytest.fail(f"pagedkv serve did not start: {(ARTIFACTS / 'dashboard-serve.log').read_text()[-2000:]}")
        time.sleep(0.5)
    yield url
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).is_file():
        pytest.fail(f"Chromium is missing ({CHROMIUM}): install Debian's `chromium` package "
                    "(apt-get install -y chromium; `make test` does it)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        yield b
        b.close()


def auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_blocks_endpoint_needs_the_key(server: str) -> None:
    assert httpx.get(f"{server}/v1/cache/blocks").status_code == 401
    assert httpx.get(f"{server}/v1/cache/blocks", headers=auth("wrong")).status_code == 401
    r = httpx.get(f"{server}/v1/cache/blocks", headers=auth())
    assert r.status_code == 200
    snap = r.json()
    assert set(snap) == ALLOWED_KEYS and snap["num_blocks"] == NUM_BLOCKS
    page = httpx.get(f"{server}/dashboard")  # static, no data: loads without the key
    assert page.status_code == 200 and "<canvas" in page.text
    assert "http://" not in page.text and "https://" not in page.text  # nothing external


def _cells(page, with_owner: bool = False) -> list[tuple]:
    """The colour at the centre of every cell, read back from the canvas (and the request id the
    page's data gives the cell's owner, or null)."""
    cells = [tuple(c) for c in page.evaluate("""() => {
        const L = window.pagedkv.layout, c = document.getElementById('map');
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        const half = Math.floor((L.cell - L.gap) / 2), out = [];
        for (let i = 0; i < L.n; i++) {
            const x = (i % L.cols) * L.cell + half, y = Math.floor(i / L.cols) * L.cell + half;
            const k = (y * c.width + x) * 4;
            const p = window.pagedkv;
            const o = p.states[i] === 2 ? p.snap.owners[p.owner[i]] : null;
            out.push([d[k], d[k + 1], d[k + 2], o]);
        }
        return out;
    }""")]
    return cells if with_owner else [c[:3] for c in cells]


def _classes(cells: list[tuple[int, int, int]]) -> dict[str, int]:
    out = {"free": 0, "cached": 0, "owned": 0, "shared": 0, "other": 0}
    for c in cells:
        if c == FREE_RGB:
            out["free"] += 1
        elif c == CACHED_RGB:
            out["cached"] += 1
        elif c in OWNED_PALETTE:
            out["owned"] += 1
        elif c in SHARED:
            out["shared"] += 1
        else:
            out["other"] += 1
    return out


def _stream(server: str, prompt: str, done: list[int], release: threading.Event) -> None:
    """Streams one long answer and hangs up once the test has looked (`release`): the requests
    stay in flight however fast the machine is, and the hang-up aborts the rest of each."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_TOKENS,
            "ignore_eos": True, "temperature": 0, "stream": True}
    chunks = 0
    with httpx.stream("POST", f"{server}/v1/chat/completions", json=body, headers=auth(),
                      timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            chunks += line.startswith("data: ")
            if chunks > 1 and release.is_set():
                break
    done.append(chunks)


def test_dashboard_in_the_browser(server: str, browser) -> None:
    page = browser.new_page(viewport={"width": 1200, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(f"{server}/dashboard")
    page.wait_for_selector("#keyform", state="visible", timeout=10_000)  # got a 401: asks
    page.fill("#key", KEY)
    page.click("#keyform button")
    page.wait_for_function("window.pagedkv.polls >= 1", timeout=10_000)
    cells = _cells(page)
    assert len(cells) == NUM_BLOCKS
    idle = _classes(cells)
    assert idle["other"] == 0 and idle["owned"] == idle["shared"] == 0, idle

    done: list[int] = []
    release = threading.Event()
    threads = [threading.Thread(target=_stream, args=(server, p, done, release))
               for p in PROMPTS]
    for t in threads:
        t.start()
    busy, deadline = None, time.monotonic() + 60
    while time.monotonic() < deadline and len(done) < len(PROMPTS):
        cells = _cells(page, with_owner=True)
        seen = _classes([c[:3] for c in cells])
        if seen["owned"] > 0:
            busy = seen
            break
        time.sleep(0.2)
    assert busy is not None, "no owned cell appeared while requests ran"
    assert busy["other"] == 0, busy
    colour_of: dict[str, set] = {}
    for *rgb, owner in cells:
        if owner is not None:
            colour_of.setdefault(owner, set()).add(tuple(rgb))
    assert all(len(c) == 1 for c in colour_of.values()), colour_of  # one colour per sequence
    assert len({next(iter(c)) for c in colour_of.values()}) == len(colour_of)  # all different
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)
    # data in flight: request ids only, no prompt text or token ids
    raw = httpx.get(f"{server}/v1/cache/blocks", headers=auth()).text
    snap = json.loads(raw)
    assert set(snap) == ALLOWED_KEYS
    assert not any(w in raw for w in ("quokka", "zebras", "moon", "rivers", "token_ids"))
    assert all(o.startswith("chatcmpl-") for o in snap["owners"])
    # hovering an owned cell names its request and outlines it
    tip = _hover_owned(page)
    assert tip is None or "owned by chatcmpl-" in tip

    release.set()  # the clients hang up: their requests end and free their blocks
    for t in threads:
        t.join(120)
    assert len(done) == len(PROMPTS) and all(n > 1 for n in done)
    page.mouse.move(0, 0)
    deadline = time.monotonic() + 15
    while True:
        after = _classes(_cells(page))
        if after["owned"] == after["shared"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert after["owned"] == after["shared"] == after["other"] == 0, after
    assert after["free"] + after["cached"] == NUM_BLOCKS
    assert after["cached"] > 0  # the ended requests' full blocks stay as a prefix cache
    assert page.eval_on_selector("#running", "e => e.textContent") == "0"
    assert not errors, errors
    page.close()


def _hover_owned(page) -> str | None:
    """Moves the mouse over an owned cell (if one is still there) and returns the tooltip."""
    i = page.evaluate("""() => {
        const s = window.pagedkv.states;
        for (let i = 0; i < s.length; i++) if (s[i] === 2) return i;
        return -1;
    }""")
    return None if i < 0 else _hover_cell(page, i)


def _hover_cell(page, i: int) -> str | None:
    """Moves the mouse over cell i and returns the tooltip."""
    layout = page.evaluate("window.pagedkv.layout")
    box = page.locator("#map").bounding_box()
    x = box["x"] + 1 + (i % layout["cols"]) * layout["cell"] + layout["cell"] / 2
    y = box["y"] + 1 + (i // layout["cols"]) * layout["cell"] + layout["cell"] / 2
    page.mouse.move(x, y)
    return page.text_content("#tip")


def test_other_tenants_blocks_are_anonymous_in_the_page(browser) -> None:
    """Tenant B's page draws tenant A's blocks in the neutral colour and never names A's
    request (the deterministic engine holding real blocks: no model needed)."""
    from test_dashboard_api import CachedFake, running

    with ServerThread(build_app(CachedFake(), api_key=["admin", "key-a", "key-b"])) as srv, \
            running(srv.url, "key-a", "A" * 21) as a_id, running(srv.url, "key-b", "B" * 9) as b_id:
        full = httpx.get(f"{srv.url}/v1/cache/blocks", headers=auth("admin")).json()
        owner = unrle(full["owner"])
        a_cells = [int(i) for i in (owner == full["owners"].index(a_id)).nonzero()[0]]
        b_cells = [int(i) for i in (owner == full["owners"].index(b_id)).nonzero()[0]]
        page = browser.new_page(viewport={"width": 1200, "height": 900})
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(f"{srv.url}/dashboard")
        page.wait_for_selector("#keyform", state="visible", timeout=10_000)
        page.fill("#key", "key-b")
        page.click("#keyform button")
        page.wait_for_function("window.pagedkv.polls >= 1", timeout=10_000)
        cells = _cells(page)
        assert {cells[i] for i in a_cells} == {tuple(COLORS["other"])}
        assert len({cells[i] for i in b_cells}) == 1 and cells[b_cells[0]] in OWNED_PALETTE
        seqs = page.text_content("#seqs")
        assert b_id in seqs and "other tenants' requests: 6 own blocks" in seqs
        tip = _hover_cell(page, a_cells[0])
        assert tip == f"block {a_cells[0]}: owned by another tenant's request"
        seen = page.content() + json.dumps(page.evaluate("window.pagedkv.snap"))
        assert a_id not in seen and b_id in seen
        assert not errors, errors
        page.close()
