"""The playground in a real browser (issue 40): headless Chromium (the distribution's package, driven by
Selenium through chromium-driver; scripts/setup.sh installs both) loads GET / from a server on loopback,
submits a prompt, waits for the decode to finish, and shows the text the HTTP API returns for the same
request, one cell per generated position; a prompt full of markup is shown as text. A screenshot is kept
(``$SETDIFF_TEST_ARTIFACTS``, default the test's temporary directory)."""
import os
import shutil
from pathlib import Path

import httpx
import pytest

from .test_serve import server  # noqa: F401  (the same server fixture: a tiny trained run on loopback)

EVIL = "<b>b</b><img src=x>"          # markup (short: the test model's context is 32 tokens)


def _driver():
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip("selenium is not installed (the [dev] extra: bash scripts/setup.sh)")
    browser = next((shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)),
                   None)
    driver = shutil.which("chromedriver")
    if browser is None or driver is None:
        pytest.skip("no Chromium / chromedriver on this machine (scripts/setup.sh installs the distribution's "
                    "chromium and chromium-driver where it runs as root or with sudo)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = browser
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1200,900"):
        opts.add_argument(a)
    return webdriver.Chrome(options=opts, service=Service(driver))


def _fill(drv, by, field: str, value: str) -> None:
    el = drv.find_element(by.ID, field)
    el.clear()
    el.send_keys(value)


def test_the_playground_decodes_in_a_browser_and_shows_what_the_api_returns(server, tmp_path):  # noqa: F811
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    srv, sch, url = server
    drv = _driver()
    try:
        for prompt in ("Question: what is 3 plus", EVIL):
            drv.get(url + "/")
            _fill(drv, By, "prompt", prompt)
            for field, value in (("max_tokens", "10"), ("tau", "0.5"), ("window", "4")):
                _fill(drv, By, field, value)
            drv.find_element(By.ID, "generate").click()
            out = drv.find_element(By.ID, "output")
            WebDriverWait(drv, 120).until(lambda d: out.get_attribute("data-done") is not None)
            assert out.get_attribute("data-done") == "1", drv.find_element(By.ID, "status").text
            api = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 10, "tau": 0.5,
                                                            "window": 4, "return_token_ids": True}, timeout=60)
            choice = api.json()["choices"][0]
            assert out.get_attribute("textContent") == choice["text"]
            cells = drv.find_elements(By.CSS_SELECTOR, "#canvas .cell")
            assert len(cells) == len(choice["token_ids"]) and not drv.find_elements(By.CSS_SELECTOR, "#canvas .masked")
            assert drv.find_element(By.ID, "shown-prompt").get_attribute("textContent") == prompt
            assert "done:" in drv.find_element(By.ID, "status").text
        # the markup in the prompt stayed text: no element was made from it, no script ran
        assert drv.title == "setdiff-mega playground"
        assert not drv.find_elements(By.CSS_SELECTOR, "body img, #shown-prompt b, #shown-prompt script")
        art = Path(os.environ.get("SETDIFF_TEST_ARTIFACTS", tmp_path))
        art.mkdir(parents=True, exist_ok=True)
        assert drv.save_screenshot(str(art / "playground.png")) and (art / "playground.png").stat().st_size > 1000
    finally:
        drv.quit()
