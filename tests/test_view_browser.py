"""`relayrl view` in a real browser: Debian's chromium, driven by Selenium through Debian's chromedriver (`make
test-slow` installs both with apt-get when missing; without them these tests skip and say so).

The first test makes a real short run (the quickstart with a tiny budget), starts `relayrl view` on it as a user
would, and checks what the page shows: a completion's text, tokens coloured by logprob, by loss mask and by weight
version, a filter and the text search, two steps side by side. Its screenshots are kept in the test's folder (the
path is printed: pytest -s shows it). The second shows an agent's episodes turn by turn."""

import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

import httpx
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")

pytestmark = [
    pytest.mark.extended,
    pytest.mark.skipif(CHROMIUM is None or CHROMEDRIVER is None,
                       reason="no browser: Debian's chromium and chromium-driver are not installed (`make test-extended` "
                       "installs them: apt-get install -y chromium chromium-driver)"),
]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


@pytest.fixture
def view(free_port):
    """start(run_dir) -> the page's URL: `relayrl view RUN_DIR --port N` as a process, stopped at teardown."""
    started = []

    def start(run_dir: pathlib.Path) -> str:
        process = subprocess.Popen([sys.executable, "-m", "deploy.cli", "view", str(run_dir), "--port", str(free_port)],
                                   env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        started.append(process)
        url = f"http://127.0.0.1:{free_port}/"
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, process.stdout.read()
            try:
                if httpx.get(url + "api/run", timeout=2).status_code == 200:
                    return url
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "relayrl view did not answer within 60 s"
            time.sleep(0.3)

    yield start
    for process in started:
        process.terminate()
        process.wait(10)


@pytest.fixture
def browser():
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (the dev extra)")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1500,1100"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


def wait_for(check, timeout_s: float = 20.0, what: str = ""):
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def backgrounds(driver) -> list[str]:
    return driver.execute_script(
        "return [...document.querySelectorAll('#pane-a .tok')].map(t => getComputedStyle(t).backgroundColor)")


def shown_samples(driver) -> list[dict]:
    return driver.execute_script("""return [...document.querySelectorAll('#pane-a .sample')].map(s => ({
        id: s.dataset.sampleId, reward: s.querySelector('.reward').textContent,
        tokens: s.querySelector('.tokens').textContent}))""")


def set_input(driver, element_id: str, text: str) -> None:
    box = driver.find_element("id", element_id)
    box.clear()
    if text:
        box.send_keys(text)
    driver.execute_script("arguments[0].dispatchEvent(new Event('input'))", box)


def quickstart_run(tmp_path: pathlib.Path) -> pathlib.Path:
    done = subprocess.run(
        # SFT long enough that some completions are right (rewards vary), RL long enough for several steps
        [sys.executable, "-m", "deploy.cli", "run", "--set", "sft.steps=200", "--set", "training.time_budget_s=45",
         "--set", "evaluation.every_s=40", "--set", "trajectory_log.every_n_groups=2"],
        capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=500, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return tmp_path / "runs" / "quickstart"


@pytest.mark.timeout(600)
def test_a_real_runs_page_shows_its_completions_coloured_filtered_and_side_by_side(tmp_path, view, browser):
    run = quickstart_run(tmp_path)
    groups = [json.loads(line) for line in (run / "trajectories.jsonl").read_text().splitlines()]
    assert groups and all(g["kind"] == "group" and g["samples"] for g in groups)
    url = view(run)
    versions = sorted({g["version"] for g in groups})
    assert len(versions) >= 2, f"the run logged groups of one policy version only ({versions}): nothing to compare"

    browser.get(url)
    wait_for(lambda: browser.find_elements("css selector", "#pane-a .group"), what="the first groups")
    facts = browser.find_element("id", "run-facts").text
    assert f"{len(groups)} groups" in facts and f"{len(versions)} step" in facts
    # the pane opens on the latest step: its first group's completions, token by token
    latest = [g for g in groups if g["version"] == versions[-1]]
    samples = shown_samples(browser)
    first = latest[0]["samples"][0]
    shown = {s["id"]: s for s in samples}
    assert first["sample_id"] in shown and first["text"] in shown[first["sample_id"]]["tokens"]
    assert len(samples) == min(20, len(latest)) * len(latest[0]["samples"])

    # logprob colours: one hue per probability, so a step's tokens are not all alike
    by_logprob = backgrounds(browser)
    assert len(by_logprob) == sum(len(s["ids"]) for g in latest[:20] for s in g["samples"])
    assert all(c not in ("rgba(0, 0, 0, 0)", "transparent") for c in by_logprob) and len(set(by_logprob)) > 1
    path = tmp_path / "view-logprob.png"
    browser.save_screenshot(str(path))
    print(f"\nscreenshot: {path}")

    browser.find_element("css selector", "input[name=colour][value=mask]").click()
    assert set(wait_for(lambda: set(backgrounds(browser)) != set(by_logprob) and backgrounds(browser))) == {
        "rgb(207, 227, 255)"}  # every completion token is trained on
    browser.find_element("css selector", "input[name=colour][value=version]").click()
    by_version = wait_for(lambda: set(backgrounds(browser)) != {"rgb(207, 227, 255)"} and backgrounds(browser))
    assert len(set(by_version)) == len({v for g in latest[:20] for s in g["samples"] for v in s["versions"]})

    # a filter: only rewarded completions; the page agrees with the log
    set_input(browser, "min-reward", "1")
    expected = sum(s["reward"] >= 1 for g in latest for s in g["samples"])
    if expected:
        wait_for(lambda: all(s["reward"] == "reward 1.00" for s in shown_samples(browser)) and shown_samples(browser),
                 what="the reward filter")
    else:
        wait_for(lambda: browser.find_elements("css selector", "#pane-a .empty"), what="an empty step")
    count = browser.find_element("css selector", "#pane-a .pane-count").text
    assert count.startswith(f"{sum(any(s['reward'] >= 1 for s in g['samples']) for g in latest)} group")
    set_input(browser, "min-reward", "")

    # text search over every step
    browser.find_element("css selector", "#pane-a select.step option[value='']").click()
    prompt = groups[0]["prompt"]["text"]
    set_input(browser, "search", prompt)
    matching = [g for g in groups if prompt.lower() in g["prompt"]["text"].lower()
                or any(prompt.lower() in s["text"].lower() for s in g["samples"])]
    wait_for(lambda: len(browser.find_elements("css selector", "#pane-a .group")) == min(20, len(matching)),
             what="the search")
    set_input(browser, "search", "")

    # two steps side by side: the first step beside the latest
    browser.find_element("id", "compare").click()
    wait_for(lambda: browser.find_elements("css selector", "#pane-b .group"), what="the second pane")
    assert browser.find_element("css selector", "#pane-b select.step").get_attribute("value") == str(versions[0])
    browser.find_element("css selector", "#pane-a select.step").click()
    browser.find_element("css selector", f"#pane-a select.step option[value='{versions[-1]}']").click()
    browser.find_element("css selector", "input[name=colour][value=logprob]").click()
    wait_for(lambda: browser.find_elements("css selector", "#pane-a .group"), what="the latest step again")
    path = tmp_path / "view-side-by-side.png"
    browser.save_screenshot(str(path))
    print(f"screenshot: {path}")


@pytest.mark.timeout(120)
def test_an_agents_episodes_show_turn_by_turn(tmp_path, view, browser):
    from tests.test_view import write_run

    browser.get(view(write_run(tmp_path / "run")))
    browser.find_element("css selector", "input[name=colour][value=mask]").click()
    wait_for(lambda: len(browser.find_elements("css selector", "#pane-a .group")) == 2, what="the latest step")
    set_input(browser, "search", "calc")  # of its two groups, the one of episodes
    wait_for(lambda: len(browser.find_elements("css selector", "#pane-a .group")) == 1, what="the search")
    turns = browser.find_elements("css selector", "#pane-a .turn")
    text = [t.text for t in turns]
    assert text[0].startswith("POLICY") and 'calc({"expr":"12*34"})' in text[0]
    assert text[1].startswith("TOOL") and text[1].endswith("408") and text[2].endswith("408")
    masked = browser.execute_script(
        "return [...document.querySelectorAll('#pane-a .sample')][0].querySelectorAll('.tok.unmasked').length")
    assert masked == 3  # the observation's tokens: not trained on
    path = tmp_path / "view-episodes.png"
    browser.save_screenshot(str(path))
    print(f"\nscreenshot: {path}")
