"""The server's chat page in a real browser (Debian's chromium, headless, driven by Selenium through chromedriver):
it loads, shows the model and plan, sends a typed message, and shows the streamed answer, which equals the API's
answer to the same conversation (greedy); a screenshot goes to the test's output folder."""
import os
import shutil
from pathlib import Path

import pytest

from test_server import MODEL, Server

webdriver = pytest.importorskip("selenium.webdriver")
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

CHROMIUM = shutil.which("chromium")
DRIVER = shutil.which("chromedriver")
pytestmark = [pytest.mark.skipif(not Path(MODEL).exists(), reason="model not fetched (make model)"),
              pytest.mark.skipif(not CHROMIUM or not DRIVER, reason="chromium and chromium-driver not installed")]


def test_chat_page_streams_an_answer(tmp_path):
    s = Server("-np", "1", "-c", "2048", key=None)
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1000,700"):
        opts.add_argument(a)
    browser = webdriver.Chrome(service=webdriver.ChromeService(executable_path=DRIVER), options=opts)
    try:
        browser.get(s.base + "/#temperature=0&max_tokens=40")
        wait = WebDriverWait(browser, 60)
        wait.until(lambda b: "plan: softmax:0-29" in b.find_element(By.ID, "model").text)
        box = browser.find_element(By.ID, "input")
        box.send_keys("What is the capital of France?")
        box.send_keys(Keys.ENTER)
        wait.until(lambda b: b.find_elements(By.CSS_SELECTOR, ".msg.assistant.done"))
        shown = browser.find_element(By.CSS_SELECTOR, ".msg.assistant.done span").text
        shot = Path(os.environ.get("STILL_TEST_OUT", tmp_path)) / "chat-page.png"
        browser.save_screenshot(str(shot))
        print(f"screenshot: {shot}")
        api = s.client().chat.completions.create(
            model="x", messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=40,
            temperature=0).choices[0].message.content
        assert shown == api.strip() and shown
        assert s.metric("still_requests_total{result=\"done\"}") == 2
        # the conversation is listed, and stays after a reload
        browser.refresh()
        wait.until(lambda b: b.find_elements(By.CSS_SELECTOR, "#convs .conv"))
        assert "capital of France" in browser.find_element(By.CSS_SELECTOR, "#convs .conv").text
        assert shot.stat().st_size > 1000
    finally:
        browser.quit()
        assert s.stop() == 0
