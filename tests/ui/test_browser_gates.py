"""A person approves and rejects commit gates in a browser: a real ``airflow api-server`` (the simple auth
manager, a user allowed to decide), headless Chromium signing in through Airflow's login page, the buttons of
the pipeline page clicked on the page itself and inside Airflow's frame. Screenshots in ``test-output/ui/``.

Skipped, saying so, without Debian's ``chromium`` and ``chromium-driver`` (as tests/ui/test_browser.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from airflow_arroyo.core.gates import GatePolicy, GateState
from airflow_arroyo.store import EpochStore
from tests.controlplane.test_store import complete
from tests.support import running, sql
from tests.ui.conftest import APPROVER, APPROVER_PASSWORD, ApiServer
from tests.ui.test_browser import CHROMEDRIVER, CHROMIUM, _shot, _wait_for

pytestmark = [pytest.mark.airflow, pytest.mark.slow]

PID = "gated-browser"


@pytest.fixture
def gates(store: EpochStore) -> Iterator[list[int]]:
    """Three completed epochs of PID with a gate of sink 'out' each: the first committed, two pending."""
    running(store, PID, stages=["src", "out"])
    try:
        epochs = [complete(store, PID) for _ in range(3)]
        for i, e in enumerate(epochs):
            store.open_gate(PID, "out", e, run_id="r1", uri="file:///tmp/gated", policy=GatePolicy.HOLD,
                            batch_from=i, batch_to=i, details={"kind": "files", "files": []}, timeout=3600.0)
        store.decide_gate(PID, "out", epochs[0], GateState.PASSED, by="check_rows")
        store.close_gate(PID, "out", epochs[0], GateState.COMMITTED)
        yield epochs
    finally:  # the dataset is shared: other tests count its pipelines
        sql(store, "DELETE FROM arroyo_pipelines WHERE pipeline_id = %s", (PID,))


@pytest.fixture
def approver_browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A browser of its own (a profile signed in as no one yet)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = str(CHROMIUM)
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--window-size=1400,1000",
                 f"--user-data-dir={tmp_path_factory.mktemp('chromium-approver')}"):
        opts.add_argument(flag)
    driver = webdriver.Chrome(options=opts, service=Service(executable_path=str(CHROMEDRIVER)))
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


def test_a_person_rejects_and_approves_gates_with_the_pages_buttons(
        api_server: ApiServer, approver_browser: Any, store: EpochStore, gates: list[int]) -> None:
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    e1, e2, e3 = gates
    d = approver_browser
    page = f"{api_server.url}/arroyo/pipelines/{PID}"
    d.get(page)
    d.find_element(By.LINK_TEXT, "Sign in").click()
    _wait_for(d, "input[name=username]").send_keys(APPROVER)
    d.find_element(By.CSS_SELECTOR, "input[name=password]").send_keys(APPROVER_PASSWORD)
    d.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
    WebDriverWait(d, 30).until(lambda drv: drv.current_url == page)
    _wait_for(d, "table#gate-table")
    rows = d.find_elements(By.CSS_SELECTOR, "table#gate-table tbody tr")
    assert [(r.get_attribute("data-epoch"), r.get_attribute("data-state")) for r in rows] == [
        (str(e2), "pending"), (str(e3), "pending"), (str(e1), "committed")]
    assert not d.find_elements(By.CSS_SELECTOR, f"tr[data-epoch='{e1}'] button")
    _shot(d, "20-gates-before")

    # Reject epoch e2 with a reason: back on the page, the row shows who and why.
    row = d.find_element(By.CSS_SELECTOR, f"tr[data-epoch='{e2}']")
    row.find_element(By.CSS_SELECTOR, "input[name=reason]").send_keys("12 negative amounts")
    row.find_element(By.CSS_SELECTOR, "button.reject").click()
    # the page reloads after the click: a row found just before the reload is stale, so look again
    WebDriverWait(d, 30, ignored_exceptions=(StaleElementReferenceException,)).until(
        lambda drv: drv.find_element(By.CSS_SELECTOR, f"tr[data-epoch='{e2}']").get_attribute("data-state")
        == "failed")
    assert d.current_url == f"{page}#gates"
    assert "12 negative amounts" in d.find_element(By.CSS_SELECTOR, f"tr[data-epoch='{e2}']").text
    g = store.get_gate(PID, "out", e2)
    assert (g.state, g.decided_by, g.reason) == (GateState.FAILED, APPROVER, "12 negative amounts")
    # a failed gate may still be approved after a look, not rejected again
    assert [b.text for b in d.find_elements(By.CSS_SELECTOR, f"tr[data-epoch='{e2}'] button")] == ["Approve"]
    _shot(d, "21-gate-rejected")

    # Approve epoch e3 from inside Airflow's frame (the extra links open the page there).
    d.get(f"{api_server.url}/plugin/arroyo/arroyo/pipelines/{PID}")
    frame = _wait_for(d, "iframe", timeout=60)
    d.switch_to.frame(frame)
    _wait_for(d, "table#gate-table")
    d.find_element(By.CSS_SELECTOR, f"tr[data-epoch='{e3}'] button.approve").click()
    WebDriverWait(d, 30, ignored_exceptions=(StaleElementReferenceException,)).until(
        lambda drv: drv.find_element(By.CSS_SELECTOR, f"tr[data-epoch='{e3}']").get_attribute("data-state")
        == "passed")
    assert not d.find_elements(By.CSS_SELECTOR, f"tr[data-epoch='{e3}'] button")
    d.switch_to.default_content()
    _shot(d, "22-gate-approved-in-airflow")
    g = store.get_gate(PID, "out", e3)
    assert (g.state, g.decided_by, g.reason) == (GateState.PASSED, APPROVER, None)
