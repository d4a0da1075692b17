"""Debian's Chromium driven by Playwright, for the status page: the test, and the screenshot in docs/.

    python -m tests.browser http://127.0.0.1:8000/dcut/ docs/status-page.png [--key KEY]

Nothing is downloaded: Playwright launches /usr/bin/chromium (`make setup` installs it with apt).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager

from playwright.sync_api import Browser, Page, sync_playwright
from playwright.sync_api import TimeoutError as PlaywrightTimeout

CHROMIUM = "/usr/bin/chromium"
# Without the background-networking flags Chromium's own connections are refused on a closed network and
# the page's console fills with their errors.
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
CHARTS = "figure.chart"


@contextmanager
def chromium() -> Iterator[Browser]:
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            yield browser
        finally:
            browser.close()


def open_page(browser: Browser, url: str, key: str | None, errors: list[str]) -> Page:
    """``url`` in a fresh context that logs in with ``key`` as a browser user would (HTTP Basic, any user);
    console errors and uncaught exceptions go to ``errors``."""
    context = browser.new_context(viewport={"width": 1360, "height": 900},
                                  http_credentials={"username": "operator", "password": key} if key else None)
    page = context.new_page()
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(url)
    return page


def wait_for_charts(page: Page, timeout_s: float) -> None:
    """Until every chart has drawn points (the page refreshes itself every 2 s); else say which have none."""
    try:
        page.wait_for_function(f"""() => {{
            const charts = [...document.querySelectorAll('{CHARTS}')];
            return charts.length > 0 && charts.every((c) => Number(c.dataset.points) > 0);
        }}""", timeout=timeout_s * 1000)
    except PlaywrightTimeout:
        empty = page.eval_on_selector_all(CHARTS, "cs => cs.filter((c) => !(Number(c.dataset.points) > 0))"
                                                  ".map((c) => c.id || c.dataset.title)")
        raise AssertionError(f"charts without data after {timeout_s} s: {empty}") from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url")
    parser.add_argument("out")
    parser.add_argument("--key", default=None, help="the app's API key, when one is set")
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args()
    errors: list[str] = []
    with chromium() as browser:
        page = open_page(browser, args.url, args.key, errors)
        wait_for_charts(page, args.timeout)
        page.screenshot(path=args.out, full_page=True)
    if errors:
        raise SystemExit(f"console errors: {errors}")


if __name__ == "__main__":
    main()
