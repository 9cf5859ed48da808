"""A real headless browser for the web pages' tests and screenshots: Debian's chromium, driven by Playwright.

Playwright's own browser download is not used (it needs the internet); its driver talks to the chromium the
project's set-up installs (``.ci/run``: ``apt-get install chromium``). The flags keep chromium from reaching out at
start (update checks, sync, component downloads), which a closed network refuses by the dozen.
"""

from __future__ import annotations

import contextlib
import shutil
from typing import Iterator

CHROMIUM_FLAGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-default-apps", "--disable-extensions", "--disable-quic"]


def expect(*args, **kwargs):
    """Playwright's ``expect`` (waits through locators: the pages' CSP forbids the eval a string predicate needs)."""
    from playwright.sync_api import expect as playwright_expect

    return playwright_expect(*args, **kwargs)


def chromium_path() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def missing() -> str | None:
    """Why no browser can run here (for a test's skip), or None."""
    if chromium_path() is None:
        return "no chromium on this machine (apt-get install chromium; .ci/run does)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed (pip install -e '.[test]')"
    return None


@contextlib.contextmanager
def browser_page(width: int = 1280, height: int = 900) -> Iterator:
    """A Playwright page in headless chromium; everything is closed afterwards."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            yield page
        finally:
            browser.close()
