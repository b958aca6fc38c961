"""A real headless Chromium for page tests, driven by Selenium through Debian's chromedriver.

No download at run time: the browser and driver are the system packages (`apt-get install chromium
chromium-driver`; `make test` installs them). A missing browser FAILS the test: it is a missing
dependency, not a reason to skip.
"""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import pytest

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")
DRIVER_NAMES = ("chromedriver",)
MISSING = "headless Chromium is required: apt-get install chromium chromium-driver (`make system-deps` does it)"


def _find(names: tuple[str, ...], extra: tuple[str, ...] = ()) -> str | None:
    for name in names:
        found = shutil.which(name)
        if found:
            return found
    return next((p for p in extra if os.access(p, os.X_OK)), None)


def browser_paths() -> tuple[str, str]:
    """(chromium, chromedriver) executables; fails the calling test when either is missing."""
    browser = _find(CHROMIUM_NAMES, ("/usr/lib/chromium/chromium",))
    driver = _find(DRIVER_NAMES, ("/usr/lib/chromium/chromedriver",))
    if browser is None or driver is None:
        pytest.fail(f"{MISSING} (chromium: {browser}, chromedriver: {driver})", pytrace=False)
    return browser, driver


@contextmanager
def chromium(profile_dir: Path, width: int = 1400, height: int = 900) -> Iterator[Any]:
    """A Selenium WebDriver on headless Chromium that records the browser console; quit on exit."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    browser, driver = browser_paths()
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--no-first-run", "--disable-extensions", "--disable-background-networking",
                f"--user-data-dir={profile_dir}", f"--window-size={width},{height}", "--force-device-scale-factor=1"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    service = Service(executable_path=driver, log_output=os.devnull)
    web = webdriver.Chrome(service=service, options=options)
    try:
        yield web
    finally:
        web.quit()


def console_errors(web: Any) -> list[dict[str, Any]]:
    """Console entries at SEVERE level since the last call (errors, CSP violations, failed loads)."""
    return [entry for entry in web.get_log("browser") if entry.get("level") == "SEVERE"]
