"""A person's walk through the plugin: a real ``airflow api-server`` (throwaway AIRFLOW_HOME, simple
auth manager with a known user), headless Chromium driven by Selenium.

Signs in through Airflow's own login page, opens a pipeline's history, an in-flight epoch, a
completed epoch, the pipelines list, the retention page, and the plugin embedded in Airflow's UI
(the ``external_views`` entry). Screenshots go to ``test-output/ui/`` (look at them).

Needs Debian's ``chromium`` and ``chromium-driver`` packages; skipped, saying so, without them.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from airflow_arroyo.core.epochs import EpochState
from tests.ui.conftest import PASSWORD, USER, ApiServer
from tests.ui.data import Dataset

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
if not (CHROMIUM and CHROMEDRIVER):
    pytest.skip("headless Chromium is not installed: apt-get install -y chromium chromium-driver "
                "(CI's setup installs them)", allow_module_level=True)

pytestmark = [pytest.mark.airflow, pytest.mark.slow]

OUT = Path(__file__).resolve().parents[2] / "test-output" / "ui"


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = str(CHROMIUM)
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--window-size=1400,1000",
                 f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}"):
        opts.add_argument(flag)
    driver = webdriver.Chrome(options=opts, service=Service(executable_path=str(CHROMEDRIVER)))
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


def _shot(driver: Any, name: str) -> Path:
    """A full-page screenshot (the window grows to the page's height first)."""
    OUT.mkdir(parents=True, exist_ok=True)
    height = driver.execute_script("return Math.max(document.documentElement.scrollHeight, 600)")
    driver.set_window_size(1400, min(int(height) + 200, 6000))
    path = OUT / f"{name}.png"
    driver.save_screenshot(str(path))
    driver.set_window_size(1400, 1000)
    return path


def _element_shot(driver: Any, css: str, name: str) -> Path:
    from selenium.webdriver.common.by import By

    OUT.mkdir(parents=True, exist_ok=True)
    driver.set_window_size(1400, 2400)  # the whole element in view
    path = OUT / f"{name}.png"
    driver.find_element(By.CSS_SELECTOR, css).screenshot(str(path))
    driver.set_window_size(1400, 1000)
    return path


def _wait_for(driver: Any, css: str, timeout: float = 30.0) -> Any:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout).until(ec.presence_of_element_located((By.CSS_SELECTOR, css)))


def test_a_person_signs_in_and_reads_the_checkpoints(api_server: ApiServer, browser: Any, dataset: Dataset) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    d = browser
    # 1. Not signed in: the plugin refuses and offers Airflow's sign-in.
    d.get(f"{api_server.url}/arroyo/pipelines/orders")
    assert d.find_element(By.TAG_NAME, "h1").text == "Sign in to Airflow"
    assert "orders" not in d.find_element(By.TAG_NAME, "main").text.replace("/arroyo/pipelines/orders", "")
    _shot(d, "01-sign-in-required")

    # 2. Airflow's own login page, then back to the pipeline.
    d.find_element(By.LINK_TEXT, "Sign in").click()
    _wait_for(d, "input[name=username]").send_keys(USER)
    d.find_element(By.CSS_SELECTOR, "input[name=password]").send_keys(PASSWORD)
    _shot(d, "02-airflow-login")
    d.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
    WebDriverWait(d, 30).until(lambda drv: drv.current_url == f"{api_server.url}/arroyo/pipelines/orders")
    _wait_for(d, "table#epochs")

    # 3. The pipeline's history: facts, chart, table.
    h1 = d.find_element(By.TAG_NAME, "h1").text
    assert "orders" in h1 and "running" in h1
    rows = d.find_elements(By.CSS_SELECTOR, "table#epochs tbody tr")
    assert len(rows) == 100 and rows[0].get_attribute("data-epoch") == "241"
    assert rows[0].get_attribute("data-state") == "triggered"
    chart = d.find_element(By.CSS_SELECTOR, "svg.history")
    assert chart.size["height"] > 200 and chart.size["width"] > 800  # drawn, not collapsed
    assert len(chart.find_elements(By.CSS_SELECTOR, "rect")) >= 100
    assert "#240" in d.find_element(By.ID, "last-completed").text
    _shot(d, "03-pipeline-orders")
    _element_shot(d, "figure.chart-box", "03b-history-chart")

    # 4. The in-flight epoch: which stages have not acknowledged.
    d.find_element(By.CSS_SELECTOR, "tr[data-epoch='241'] a").click()
    _wait_for(d, "table#stages")
    plan = dataset.plan("orders")
    pending = [li.text for li in d.find_elements(By.CSS_SELECTOR, "#pending li.pending-stage")]
    assert pending == [s for s in plan.stages if s not in plan.epochs[-1].acked_stages]
    assert d.find_element(By.CSS_SELECTOR, "svg.timeline").size["height"] > 100
    _shot(d, "04-epoch-241-in-flight")

    # 5. The epoch before it, completed: every stage acknowledged, with its timings.
    d.find_element(By.CSS_SELECTOR, "a[rel=prev]").click()
    _wait_for(d, "table#stages")
    assert d.find_element(By.TAG_NAME, "h1").text.startswith("Epoch 240")
    statuses = {r.get_attribute("data-stage"): r.get_attribute("data-status")
                for r in d.find_elements(By.CSS_SELECTOR, "table#stages tbody tr")}
    assert statuses == dict.fromkeys(plan.stages, "acknowledged")
    _shot(d, "05-epoch-240-completed")
    _element_shot(d, "figure.chart-box", "05b-epoch-timeline")

    # 6. All pipelines, with their warnings.
    d.find_element(By.CSS_SELECTOR, "header a.brand").click()
    _wait_for(d, "table#pipelines")
    clicks = d.find_element(By.CSS_SELECTOR, "tr[data-pipeline='clicks'] td.health")
    assert "critical" in clicks.text and "the last 4 checkpoints failed" in clicks.text
    assert "overdue" in d.find_element(By.CSS_SELECTOR, "tr[data-pipeline='sessions'] td.health").text
    _shot(d, "06-pipelines")

    # 7. Retention of a pipeline whose cleanup holds the lock now.
    d.find_element(By.CSS_SELECTOR, "tr[data-pipeline='clicks'] a.lock-held").click()
    _wait_for(d, "#cleanup-runs")
    assert d.find_element(By.ID, "lock").get_attribute("data-live") == "true"
    _shot(d, "07-retention-clicks")


def test_the_plugin_is_in_airflows_navigation(api_server: ApiServer, browser: Any) -> None:
    """The ``external_views`` entry: Airflow's UI frames the plugin at /plugin/arroyo."""
    from selenium.webdriver.common.by import By

    d = browser  # signed in by the test above (same browser profile); sign in here if run alone
    d.get(f"{api_server.url}/plugin/arroyo")
    if "/auth/login" in d.current_url:
        _wait_for(d, "input[name=username]").send_keys(USER)
        d.find_element(By.CSS_SELECTOR, "input[name=password]").send_keys(PASSWORD)
        d.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
    frame = _wait_for(d, "iframe", timeout=60)
    assert frame.get_attribute("src").endswith("/arroyo/")
    d.switch_to.frame(frame)
    _wait_for(d, "table#pipelines")
    ids = [r.get_attribute("data-pipeline") for r in d.find_elements(By.CSS_SELECTOR, "tr[data-pipeline]")]
    assert ids == ["clicks", "fresh", "orders", "payments", "sessions"]
    d.switch_to.default_content()
    _shot(d, "08-embedded-in-airflow")


#: What a real run writes as "triggered by" / lease holder (the test data has short ones).
LONG_TOKEN = "airflow:example_streaming_pipeline/checkpoints/manual__2026-11-23T13:23:52.123456+00:00"


def _overflow(driver: Any, realistic: bool = True) -> int:
    """How many pixels the page is wider than the window (0: nothing to scroll sideways), after
    putting the long names a real run writes into the "by"/holder cells."""
    if realistic:
        driver.execute_script("document.querySelectorAll('td.by').forEach(td => td.textContent = arguments[0])",
                              LONG_TOKEN)
    return int(driver.execute_script(
        "return document.documentElement.scrollWidth - document.documentElement.clientWidth"))


def test_what_a_newcomer_met_reads_right(api_server: ApiServer, browser: Any, dataset: Dataset) -> None:
    """Issue 10, section 4, in a browser 1440 px wide: tables fit, the summary and the restore hint
    are there, the retention policy reads as words, an empty chart does not repeat "0 B", a page
    with an epoch in flight reloads itself, and the checkpoint link keeps Airflow's frame."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    d = browser
    d.get(f"{api_server.url}/arroyo/pipelines/orders")
    if "/auth/login" in d.current_url or d.find_element(By.TAG_NAME, "h1").text == "Sign in to Airflow":
        if "/auth/login" not in d.current_url:
            d.find_element(By.LINK_TEXT, "Sign in").click()
        _wait_for(d, "input[name=username]").send_keys(USER)
        d.find_element(By.CSS_SELECTOR, "input[name=password]").send_keys(PASSWORD)
        d.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
        WebDriverWait(d, 30).until(lambda drv: drv.current_url.endswith("/arroyo/pipelines/orders"))
    d.set_window_size(1440, 1000)

    # The history: no sideways scrolling at 1440 px; the summary; the interval recorded.
    _wait_for(d, "table#summary")
    assert _overflow(d) <= 0, _overflow(d)
    # Narrower still (1200 px) it fits; and the check has teeth: with the cells as they were (no
    # wrapping, full-size font) the same names push the table past the window.
    d.set_window_size(1200, 1000)
    assert _overflow(d) <= 0, _overflow(d)
    d.execute_script("document.querySelectorAll('td.by').forEach(td => {"
                     " td.style.whiteSpace = 'nowrap'; td.style.fontSize = '14px'; })")
    assert _overflow(d, realistic=False) > 0
    d.set_window_size(1440, 1000)
    summary = d.find_element(By.ID, "summary").text
    assert "Completed" in summary and "Duration p50" in summary and "Size p99" in summary
    assert d.find_element(By.ID, "interval").text == "30 s"
    # An epoch is in flight: the page reloads itself (no script of ours: a <meta> refresh).
    assert "refreshes every 5 s" in d.find_element(By.ID, "auto-refresh").text
    d.execute_script("window.__before_refresh = true")
    WebDriverWait(d, 20).until(lambda drv: drv.execute_script("return window.__before_refresh") is None)
    _shot(d, "09-history-1440-summary")

    # A completed epoch says how to restore from it.
    d.get(f"{api_server.url}/arroyo/pipelines/orders/epochs/240")
    hint = _wait_for(d, "#restore").text
    assert "restore_from=240" in hint and "--restore-from 240" in hint
    assert _overflow(d) <= 0, _overflow(d)
    _shot(d, "10-epoch-240-restore-hint")

    # Retention: fits, and the policy is words, not a Python dict.
    d.get(f"{api_server.url}/arroyo/pipelines/orders/retention")
    _wait_for(d, "#cleanup-runs")
    assert _overflow(d) <= 0, _overflow(d)
    policies = [td.text for td in d.find_elements(By.CSS_SELECTOR, "#cleanup-runs td.policy")]
    assert policies and all(p.startswith("keep the last") for p in policies), policies
    _shot(d, "11-retention-1440")

    # A page of history without sizes (a failed epoch): the size panels say so instead of an axis of
    # "0 B, 0 B, 0 B, 1 B".
    from airflow_arroyo.store import EpochStore

    store = EpochStore(dataset.dsn)
    try:
        sizeless = next(e.epoch for e in store.list_epochs("orders", limit=300)
                        if e.bytes_total is None and e.bytes_new is None and e.state is not EpochState.TRIGGERED)
    finally:
        store.close()
    d.get(f"{api_server.url}/arroyo/pipelines/orders?before={sizeless + 1}&limit=1")
    chart = _wait_for(d, "svg.history")
    labels = [t.text for t in chart.find_elements(By.TAG_NAME, "text")]
    assert labels.count("0 B") == 0 and labels.count("no size reported yet") == 2, labels
    _element_shot(d, "figure.chart-box", "12-empty-chart")

    # The checkpoint link of a task opens the page inside Airflow's UI (its navigation around it).
    from airflow_arroyo.links.pipeline import pipeline_page_url

    d.get(pipeline_page_url("orders", base_url=api_server.url))
    frame = _wait_for(d, "iframe", timeout=60)
    assert frame.get_attribute("src").endswith("/arroyo/pipelines/orders")
    assert "/plugin/arroyo/" in d.current_url  # Airflow's page, with our page in its frame
    assert not d.find_elements(By.CSS_SELECTOR, "table#epochs")  # (not our page on its own)
    d.switch_to.frame(frame)
    _wait_for(d, "table#epochs")
    assert _overflow(d) <= 0, _overflow(d)  # fits the frame Airflow leaves it at 1440 px
    d.switch_to.default_content()
    d.set_window_size(1440, 1000)
    d.save_screenshot(str(OUT / "13-checkpoint-link-in-airflow-frame.png"))
