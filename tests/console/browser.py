"""Debian's Chromium driven by Selenium, headless, and what the console tests ask of a page.

scripts/services.sh installs `chromium` and `chromium-driver`; nothing is downloaded (the paths
are given, so Selenium Manager never looks for a browser)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException, WebDriverException
from selenium.webdriver.chrome.service import Service as DriverService
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webelement import WebElement

from tests.helpers import wait_for

T = TypeVar("T")
DESKTOP = (1280, 900)
PHONE = (390, 844)
# Screenshots are written here when CONSOLE_SCREENSHOTS names a directory (CI keeps them).
SCREENSHOTS = os.environ.get("CONSOLE_SCREENSHOTS")


def executables() -> tuple[str, str]:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    assert browser and driver, (
        "the console tests need Debian's chromium and chromium-driver (scripts/services.sh "
        "installs them)"
    )
    return browser, driver


@contextmanager
def chromium() -> Iterator[webdriver.Chrome]:
    browser, driver = executables()
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu",
                     "--disable-dev-shm-usage", "--disable-extensions",
                     f"--window-size={DESKTOP[0]},{DESKTOP[1]}"):  # fmt: skip
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    chrome = webdriver.Chrome(options=options, service=DriverService(executable_path=driver))
    try:
        yield chrome
    finally:
        chrome.quit()


class Page:
    """A browser on the console at `base` (http://host:port)."""

    def __init__(self, driver: webdriver.Chrome, base: str) -> None:
        self.driver = driver
        self.base = base

    def open(self, route: str) -> None:
        """Load the console at `#<route>`: a full load from another URL; from the console, a
        change of its fragment, as a link (the previous page's streams end either way)."""
        self.driver.get(f"{self.base}/ui/#{route}")
        self.settled()

    def go(self, route: str) -> None:
        """Navigate within the loaded console, as a link would."""
        self.driver.execute_script("location.hash = arguments[0]", route)
        self.settled()

    def settled(self, timeout: float = 30) -> None:
        """Until the page has rendered (<main> no longer busy) or shown the key prompt."""

        def done() -> bool:
            return bool(self.driver.execute_script(
                "const m = document.getElementById('view');"
                "return m && !m.hasAttribute('aria-busy') && document.readyState === 'complete'"
                " || document.getElementById('key-dialog')?.open"
            ))  # fmt: skip

        wait_for(done, f"{self.driver.current_url} to render", timeout, interval=0.05)

    def find(self, css: str) -> WebElement:
        return self.driver.find_element(By.CSS_SELECTOR, css)

    def all(self, css: str) -> list[WebElement]:
        return self.driver.find_elements(By.CSS_SELECTOR, css)

    def text(self, css: str = "main") -> str:
        return self.find(css).text

    def eventually(
        self, what: str | Callable[[], str], condition: Callable[[], T], timeout: float = 60
    ) -> T:
        """`condition()` once truthy, asked again while the page re-renders under it (or the
        browser does not answer: its last such error is told if the time runs out)."""
        refused: list[WebDriverException] = []

        def asked() -> T | None:
            try:
                return condition()
            except (StaleElementReferenceException, WebDriverException) as error:
                refused[:] = [error]
                return None

        def described() -> str:
            told = f"{what() if callable(what) else what} (the page: {self.state()})"
            return f"{told} (last: {refused[0]!r})" if refused else told

        return wait_for(asked, described, timeout, interval=0.05)  # type: ignore[arg-type]

    def state(self) -> str:
        """Where the page is, whether the key prompt is open, and the start of what it shows."""
        try:
            return str(self.driver.execute_script(
                "const main = document.getElementById('view');"
                "const prompt = document.getElementById('key-dialog');"
                "return `${location.hash} key prompt open: ${!!prompt?.open}"
                " busy: ${!!main?.hasAttribute('aria-busy')} shows: `"
                " + (main?.innerText || '').slice(0, 200)"
            ))  # fmt: skip
        except WebDriverException as error:
            return f"no answer ({error!r})"

    def click(self, css: str) -> None:
        """Click `css`, found again where a live page re-rendered it between finding and
        clicking (the jobs list redraws its rows as their progress moves)."""

        def clicked() -> bool:
            self.find(css).click()
            return True

        self.eventually(f"{css} to take a click", clicked, 30)

    def errors(self) -> list[dict[str, Any]]:
        """Severe browser console messages since the last call (script errors, CSP refusals)."""
        found: list[dict[str, Any]] = self.driver.get_log("browser")
        return [m for m in found if m["level"] == "SEVERE"]

    def screenshot(self, name: str, at: str | None = None) -> None:
        """Both widths, scrolled to the element `at` (CSS), when CONSOLE_SCREENSHOTS names a
        directory."""
        if not SCREENSHOTS:
            return
        folder = Path(SCREENSHOTS)
        folder.mkdir(parents=True, exist_ok=True)
        if at:
            self.driver.execute_script("arguments[0].scrollIntoView()", self.find(at))
        self.driver.save_screenshot(str(folder / f"{name}.png"))
        self.driver.set_window_size(*PHONE)
        self.driver.save_screenshot(str(folder / f"{name}-phone.png"))
        self.driver.set_window_size(*DESKTOP)
