"""The chat page at `/`, in a real browser: headless Chromium (Debian's `chromium` and
`chromium-driver`, installed by scripts/install-test-packages) driven through selenium.

INGOT_CHAT_SCREENSHOT=FILE saves a screenshot of the page after the first answer.
"""
import os
import re
import shutil

import pytest

from conftest import MODEL_NAME, Server

TIMEOUT = 120


@pytest.fixture(scope="module")
def browser():
    chromium, chromedriver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and chromedriver):
        pytest.skip("chromium or chromedriver missing: scripts/install-test-packages installs them")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1200,800"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(chromedriver), options=options)
    yield driver
    driver.quit()


def wait(driver, condition, message):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, TIMEOUT).until(lambda d: condition(d), message)


def open_page(driver, base):
    driver.get(base + "/")
    driver.execute_script("localStorage.clear()")
    driver.get(base + "/")
    wait(driver, lambda d: d.find_element("id", "model").text == MODEL_NAME, "the page never showed the model")


def set_field(driver, id, value):
    driver.execute_script(
        "const el = document.getElementById(arguments[0]); el.value = arguments[1];"
        " el.dispatchEvent(new Event('change'));", id, value)


def ask(driver, text):
    from selenium.webdriver.common.keys import Keys

    before = len(driver.find_elements("css selector", ".message.assistant"))
    box = driver.find_element("id", "input")
    box.send_keys(text)
    box.send_keys(Keys.ENTER)
    wait(driver, lambda d: len(d.find_elements("css selector", ".message.assistant")) > before, "no answer appeared")
    return driver.find_elements("css selector", ".message.assistant")[-1]


def finished(message):
    return "finish:" in message.find_element("css selector", ".meta").text


def words(text):
    """Text without Markdown's marks, as words: what the page shows of an answer."""
    text = re.sub(r"^\s*([-*+]|\d+[.)]|#+|>)\s+", "", text, flags=re.M)
    return re.sub(r"[*`]", "", text).split()


def test_page_streams_greedy_answers_and_keeps_the_conversation(server, client, browser):
    open_page(browser, server.base)
    set_field(browser, "temperature", "0")
    set_field(browser, "max_tokens", "24")
    question = "What is the capital of France?"
    answer = ask(browser, question)
    wait(browser, lambda d: finished(answer), "the answer did not finish")
    if os.environ.get("INGOT_CHAT_SCREENSHOT"):
        browser.save_screenshot(os.environ["INGOT_CHAT_SCREENSHOT"])
    shown = answer.find_element("css selector", ".body").text
    api = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": question}], max_tokens=24, temperature=0, top_p=0.95)
    assert words(shown) == words(api.choices[0].message.content)
    assert "finish: length" in answer.text or "finish: stop" in answer.text

    # The second turn is sent with the first one's history.
    second = ask(browser, "And of Italy?")
    wait(browser, lambda d: finished(second), "the second answer did not finish")
    history = [{"role": "user", "content": question},
               {"role": "assistant", "content": api.choices[0].message.content},
               {"role": "user", "content": "And of Italy?"}]
    api2 = client.chat.completions.create(model=MODEL_NAME, messages=history, max_tokens=24, temperature=0, top_p=0.95)
    assert words(second.find_element("css selector", ".body").text) == words(api2.choices[0].message.content)

    # The conversation survives a reload, listed by its first question.
    browser.refresh()
    wait(browser, lambda d: len(d.find_elements("css selector", ".message")) == 4, "the conversation was not restored")
    titles = [li.text for li in browser.find_elements("css selector", "#conversations li .open")]
    assert titles == [question]


def test_stop_button_ends_the_stream_and_frees_the_request(server, browser):
    open_page(browser, server.base)
    set_field(browser, "max_tokens", "2000")
    # A sampled answer may end at the end-of-sequence token before the click (the Stop
    # button is hidden then): the request asks to ignore it, so the stream runs until
    # stopped.
    browser.execute_script("""
        const real = window.fetch;
        window.fetch = (url, init) => {
            if (String(url).endsWith('/v1/chat/completions')) {
                init = {...init, body: JSON.stringify({...JSON.parse(init.body), ignore_eos: true})};
            }
            return real(url, init);
        };
    """)
    answer = ask(browser, "Write a very long story about a lighthouse.")
    wait(browser, lambda d: answer.find_element("css selector", ".body").text.strip(), "no token arrived")
    browser.find_element("id", "stop").click()
    wait(browser, lambda d: answer.find_element("css selector", ".meta").text == "stopped", "stop did not end the answer")
    wait(browser, lambda d: server.metrics()["ingot:num_requests_running"] == 0, "the engine kept the stopped request")
    assert server.metrics()['ingot:request_success_total{finished_reason="abort"}'] >= 1


def test_model_output_is_never_markup(server, browser):
    """An answer holding HTML is shown as text: fetch is replaced by one that streams it."""
    open_page(browser, server.base)
    browser.execute_script(r"""
        const answer = 'Here: <script>window.__pwned = 1</script> <img src=x onerror="window.__pwned = 2">'
            + ' **bold** [link](javascript:window.__pwned=3) `<b>code</b>`\n```html\n<script>window.__pwned = 4</script>\n```';
        const events = [
            {choices: [{index: 0, delta: {role: 'assistant', content: answer}, finish_reason: null}]},
            {choices: [{index: 0, delta: {}, finish_reason: 'stop'}]},
        ].map(e => 'data: ' + JSON.stringify(e) + '\n\n').join('') + 'data: [DONE]\n\n';
        const real = window.fetch;
        window.fetch = (url, init) => String(url).endsWith('/v1/chat/completions')
            ? Promise.resolve(new Response(events, {status: 200, headers: {'Content-Type': 'text/event-stream'}}))
            : real(url, init);
    """)
    answer = ask(browser, "Say some HTML")
    wait(browser, lambda d: finished(answer), "the answer did not finish")
    body = answer.find_element("css selector", ".body")
    assert browser.execute_script("return window.__pwned") is None
    assert body.find_elements("css selector", "script, img, b, a") == []
    assert body.find_elements("css selector", "strong")[0].text == "bold"
    text = body.text
    assert "<script>window.__pwned = 1</script>" in text
    assert '<img src=x onerror="window.__pwned = 2">' in text
    assert "<b>code</b>" in text
    assert body.find_element("css selector", "pre code").text == "<script>window.__pwned = 4</script>"


def test_page_asks_for_the_api_key(browser):
    keyed = Server("--api-key", "page-secret")
    try:
        browser.get(keyed.base + "/")
        browser.execute_script("localStorage.clear()")
        browser.get(keyed.base + "/")
        wait(browser, lambda d: d.find_element("id", "key-dialog").get_attribute("open") is not None,
             "the page did not ask for the key")
        browser.find_element("id", "key").send_keys("page-secret")
        browser.find_element("css selector", "#key-form button").click()
        wait(browser, lambda d: d.find_element("id", "model").text == MODEL_NAME, "the key was not used")
        set_field(browser, "max_tokens", "4")
        answer = ask(browser, "Hi")
        wait(browser, lambda d: finished(answer), "no answer with the key")
        assert "error" not in answer.get_attribute("class")
    finally:
        keyed.stop()
