"""The web page, end to end in a real browser (Debian's Chromium driven by Playwright) against a real server."""

from __future__ import annotations

import importlib.util
import os
import shutil

import pytest

pytest.importorskip("fastapi")

from conftest import corpus_text  # noqa: E402
from test_server import Server  # noqa: E402

from semanticache_rag import Engine  # noqa: E402
from semanticache_rag.server import create_app  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
REQUIRED = bool(os.environ.get("SEMANTICACHE_REQUIRE_BROWSER"))  # CI installs Chromium: there it must run
needs_browser = pytest.mark.skipif(
    not REQUIRED and (CHROMIUM is None or importlib.util.find_spec("playwright") is None),
    reason="needs Chromium (apt-get install chromium) and playwright (pip install playwright)",
)
# Flags for a sandboxed, offline machine: no GPU, no background network calls.
CHROMIUM_ARGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="module")
def server(tiny_llama, tiny_tokenizer):
    engine = Engine(tiny_llama, tiny_tokenizer, model_name="tiny", prefill_chunk=64, section_tokens=256)
    running = Server(create_app(engine))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield launched
        launched.close()


@needs_browser
def test_upload_watch_reading_ask_see_pages_and_delete(server, browser, tmp_path):
    document = tmp_path / "licence.txt"
    document.write_text(corpus_text()[:9000])  # longer than the tiny model's context: read in sections
    page = browser.new_page()
    errors = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(server.url)
    page.get_by_text("tiny").wait_for()
    page.set_input_files("#file", str(document))
    item = page.locator("li.doc", has_text="licence.txt")
    item.get_by_role("button", name="Chat").wait_for()
    item.locator("text=/section\\(s\\); cache/").wait_for(timeout=60_000)  # read: size and compression shown
    assert "MiB" in item.inner_text()
    item.get_by_role("button", name="Chat").click()
    page.get_by_label("Question").fill("What may the licensee do?")
    page.get_by_role("button", name="Ask").click()
    sources = page.locator(".sources")
    sources.filter(has_text="Pages:").wait_for(timeout=60_000)
    assert page.locator(".answer").first.inner_text().strip() != "" or sources.inner_text()
    assert page.locator(".question").first.inner_text() == "What may the licensee do?"
    item.get_by_role("button", name="Delete licence.txt").click()
    page.locator("li.doc", has_text="licence.txt").wait_for(state="detached")
    assert errors == []


@needs_browser
def test_the_page_says_what_went_wrong(server, browser, tmp_path):
    broken = tmp_path / "broken.pdf"
    broken.write_bytes(b"%PDF-1.4 not really")
    page = browser.new_page()
    page.goto(server.url)
    page.set_input_files("#file", str(broken))
    page.locator("#status", has_text="not a readable PDF").wait_for(timeout=30_000)
