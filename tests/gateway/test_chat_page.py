"""The chat page at / in headless Chromium, against the real stack: gateway, attention service and two
expert services on the demo model (random weights: the text is gibberish, but it streams).

Driven with Selenium and the system's chromium + chromedriver (Debian's `chromium`, `chromium-driver`;
`.ci/run` installs them where it can). Without them the tests skip, saying what is missing.
"""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import httpx
import pytest

from tests.support.gateway_http import metric, running_gateway, wait_http, wait_until_idle
from tests.support.stack import running_stack

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (the test extra has it)")
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

pytestmark = pytest.mark.stack  # headless Chromium against the services as real processes

API_KEY = "page-key"
LONG_TOKENS = 1900  # under the demo's 2048-token context with the prompt: seconds of decoding to stop within
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
SCREENSHOT_DIR = os.environ.get("SPLITMOE_SCREENSHOT_DIR")  # set to keep a picture of the page


def find_browser() -> tuple[str, str]:
    browser = next((path for name in BROWSERS if (path := shutil.which(name))), None)
    driver = shutil.which("chromedriver")
    if browser is None or driver is None:
        missing = " and ".join(n for n, p in (("chromium", browser), ("chromedriver", driver)) if p is None)
        pytest.skip(f"no {missing} on PATH: install Debian's chromium and chromium-driver (.ci/run does, as root)")
    return browser, driver


@pytest.fixture(scope="module")
def browser():
    binary, driver_path = find_browser()
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1100,800",
                "--disable-gpu", "--no-first-run"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # the page's console, for errors
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=driver_path))
    driver.set_script_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def stack(demo_gguf, tmp_path_factory):
    with running_stack(demo_gguf, tmp_path_factory.mktemp("chat_page")) as s:
        yield s


@pytest.fixture
def page(browser, stack):
    """The page freshly loaded, with no conversation."""
    browser.get(stack.url + "/")
    WebDriverWait(browser, 30).until(lambda d: d.find_element(By.ID, "model").get_attribute("value"))
    return browser


def settings(page, **fields: str) -> None:
    if not page.find_element(By.ID, "settings").is_displayed():
        page.find_element(By.ID, "settings-toggle").click()
    for field_id, value in fields.items():
        box = page.find_element(By.ID, field_id.replace("_", "-"))
        box.clear()
        box.send_keys(value)


def send(page, text: str) -> None:
    page.find_element(By.ID, "prompt").send_keys(text)
    page.find_element(By.ID, "send").click()


def last_reply(page):
    return page.find_elements(By.CSS_SELECTOR, ".message.assistant")[-1]


def finished(page, timeout_s: float = 60.0):
    return WebDriverWait(page, timeout_s).until(lambda d: last_reply(d).get_attribute("data-done") == "true" and
                                                last_reply(d))


def screenshot(page, name: str) -> None:
    if SCREENSHOT_DIR:
        Path(SCREENSHOT_DIR).mkdir(parents=True, exist_ok=True)
        page.save_screenshot(str(Path(SCREENSHOT_DIR) / f"{name}.png"))


def test_the_page_loads_with_the_served_model_and_nothing_from_elsewhere(page, stack):
    assert page.title == "SplitMoE chat"
    assert page.find_element(By.ID, "model").get_attribute("value") == "demo"
    urls = page.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    assert urls and all(url.startswith(stack.url) for url in urls), urls
    assert not [e for e in page.get_log("browser") if e["level"] == "SEVERE"]


def test_a_message_streams_its_reply_and_the_conversation_goes_on(page):
    settings(page, max_tokens="12", temperature="0", extra='{"ignore_eos": true}')
    send(page, "Why is the sky blue?")
    reply = finished(page)
    first = reply.find_element(By.CLASS_NAME, "content").text
    assert first and "stopped" not in reply.get_attribute("class")
    assert page.find_element(By.ID, "status").text == "Stopped at max tokens."
    send(page, "And at sunset?")
    second = finished(page).find_element(By.CLASS_NAME, "content").text
    assert second
    texts = [m.find_element(By.CLASS_NAME, "content").text for m in page.find_elements(By.CLASS_NAME, "message")]
    assert texts == ["Why is the sky blue?", first, "And at sunset?", second]
    screenshot(page, "conversation")


def test_stop_ends_a_generation_mid_way_and_the_gateway_cancels_it(page, stack):
    with httpx.Client(base_url=stack.url, timeout=10) as http:
        steps = metric(http.get("/metrics").text, "splitmoe:scheduler_steps_total")
        settings(page, max_tokens=str(LONG_TOKENS), temperature="1", extra='{"ignore_eos": true}')
        send(page, "Tell me a long story.")
        # Streamed text on the page while the reply is still streaming: then stop it.
        WebDriverWait(page, 30, poll_frequency=0.02).until(
            lambda d: "streaming" in last_reply(d).get_attribute("class") and
            len(last_reply(d).find_element(By.CLASS_NAME, "content").text) > 0)
        page.find_element(By.ID, "stop").click()
        reply = finished(page, 10)
        assert "stopped" in reply.get_attribute("class") and page.find_element(By.ID, "status").text == "Stopped."
        assert page.find_element(By.ID, "send").is_displayed() and not page.find_element(By.ID, "stop").is_displayed()
        shown = reply.find_element(By.CLASS_NAME, "content").text
        wait_until_idle(http)
        # The attention service stepped for this request only until the hang-up reached it: fewer steps than
        # its prefill and LONG_TOKENS decodes (not finished, nor still running).
        made = metric(http.get("/metrics").text, "splitmoe:scheduler_steps_total") - steps
        assert 1 < made < LONG_TOKENS, made
        time.sleep(0.3)
        assert reply.find_element(By.CLASS_NAME, "content").text == shown  # nothing more arrived
    screenshot(page, "stopped")


def test_errors_show_the_gateways_message(page):
    settings(page, extra='{"top_k": -5}')
    send(page, "hi")
    finished(page)
    status = page.find_element(By.ID, "status")
    assert "top_k" in status.text and "error" in status.get_attribute("class")


def test_with_an_api_key_the_page_asks_for_it_and_sends_it(browser, stack, tmp_path):
    with running_gateway(stack.attention_port, tmp_path / "gateway.log", "--api-key", API_KEY) as url:
        wait_http(url + "/health", None, lambda r: r.status_code == 200)
        browser.get(url + "/")
        status = browser.find_element(By.ID, "status")
        WebDriverWait(browser, 30).until(lambda d: "API key" in status.text)
        assert browser.find_element(By.ID, "api-key").is_displayed()
        settings(browser, api_key=API_KEY, max_tokens="4", extra='{"ignore_eos": true}')
        browser.find_element(By.ID, "temperature").click()  # leave the key field: its change loads the models
        WebDriverWait(browser, 30).until(lambda d: d.find_element(By.ID, "model").get_attribute("value") == "demo")
        send(browser, "hi")
        assert finished(browser).find_element(By.CLASS_NAME, "content").text
        browser.execute_script("sessionStorage.clear()")
