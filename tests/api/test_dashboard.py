"""The web dashboard (issue 13) in real headless Chromium against a running job: it renders
the operators' key groups and the timelines, a rescale from the page takes effect, and the
page cannot be opened without the one-time login link. Screenshots are kept in
``test-artifacts/`` (git-ignored) for a person to look at."""

from __future__ import annotations

import re
import shutil
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import keyscale as ks
from conftest import write_events
from keyscale.checkpoint.jobdir import JobDir
from keyscale.cli.folder import FolderServer, folder_rows
from keyscale.runtime.control.auth import check_request
from keyscale.runtime.control.server import ADDRESS, call
from keyscale.web import Logins, static_file

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "test-artifacts"
pytestmark = pytest.mark.skipif(not (shutil.which("chromium") and shutil.which("chromedriver")),
                                reason="needs Debian's chromium and chromium-driver (make test installs them)")


@pytest.fixture
def browser() -> Iterator[Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="keyscale-chromium-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage", "--window-size=1400,1600", f"--user-data-dir={profile}"):
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # the console: a 404 or a script error shows there
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver") or "/usr/bin/chromedriver"), options=opts)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def _wait(pred: Any, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


@pytest.mark.slow
def test_the_dashboard_shows_the_job_and_rescales_it(spark: Any, tmp_path: Path, browser: Any) -> None:
    from selenium.webdriver.common.by import By

    inp = tmp_path / "in"
    write_events(inp, files=3, rows=2000, keys=300)
    events = spark.readStream.schema("key string, value long, ts timestamp").option("maxFilesPerTrigger", 1).parquet(str(inp))
    job = (ks.stream(events).key_by("key").aggregate(uid="totals", count=ks.aggregates.count(), total=ks.aggregates.sum("value"))
           .sink(ks.sinks.ParquetSink(str(tmp_path / "out"))).start(str(tmp_path / "job"), 2, name="clicks", trigger_interval="300 milliseconds"))
    jd = JobDir(str(tmp_path / "job"))
    try:
        _wait(lambda: job.status()["last_checkpoint"] == 2, "three batches")
        job.savepoint()
        base = jd.read_json(ADDRESS)["url"]
        # Without the login link the page is refused.
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(base + "/ui/", timeout=10)
        assert refused.value.code == 401

        link = call(jd, "POST", "/ui/token")["url"]
        browser.get(link)
        _wait(lambda: browser.execute_script("return document.body.dataset.loaded") == "true", "the page to load")
        assert browser.find_element(By.ID, "job").text == "clicks"
        assert browser.find_element(By.ID, "state").text == "running"
        strips = browser.find_elements(By.CSS_SELECTOR, "[data-operator=totals] rect.subtask")
        assert len(strips) == 2
        assert len(browser.find_elements(By.CSS_SELECTOR, ".chart canvas")) >= 3  # uPlot drew three timelines
        assert "n/a" in browser.find_element(By.ID, "chart-backlog").text  # and files have no backlog to draw
        # The files' modification times are the records' append times: p50, p99 and max of each
        # batch, and its lag (its oldest record's wait when it began), drawn for the batches with records.
        assert browser.execute_script("return charts['chart-latency'].series.map((s) => s.label)") == ["Time", "p50", "p99", "max", "lag"]
        assert browser.execute_script("return charts['chart-latency'].data[4].filter((v) => v != null).length") >= 1
        assert len(browser.find_elements(By.CSS_SELECTOR, "#checkpoints tbody tr")) == 3
        assert browser.find_element(By.CSS_SELECTOR, "#checkpoints tbody tr td:nth-child(5)").text.endswith(" s")
        assert len(browser.find_elements(By.CSS_SELECTOR, "#savepoints tbody tr")) == 1
        assert browser.find_element(By.ID, "outputs").text == f"'totals' → parquet files in {tmp_path / 'out'}"
        ARTIFACTS.mkdir(exist_ok=True)
        browser.save_screenshot(str(ARTIFACTS / "dashboard-running.png"))

        # A rescale from the page: pending at once, applied by the next batch.
        field = browser.find_element(By.ID, "parallelism")
        field.clear()
        field.send_keys("3")
        browser.find_element(By.ID, "rescale").click()
        _wait(lambda: "requested" in browser.find_element(By.ID, "result").text, "the page's answer")
        assert job.status()["pending_rescale"]["parallelism"] == {"*": 3}
        write_events(inp, files=1, rows=2000, keys=300, first=3)
        _wait(lambda: job.status()["operators"]["totals"]["parallelism"] == 3 and job.status()["last_checkpoint"] == 3, "the rescale")
        _wait(lambda: len(browser.find_elements(By.CSS_SELECTOR, "[data-operator=totals] rect.subtask")) == 3, "the page to show 3 subtasks")
        assert "rescale of 'totals' 2 → 3" in browser.find_element(By.ID, "events").text
        browser.save_screenshot(str(ARTIFACTS / "dashboard-rescaled.png"))

        # The folder page lists the job and opens its dashboard through a fresh one-time link.
        folder = FolderServer(str(tmp_path))
        try:
            with pytest.raises(urllib.error.HTTPError) as no_login:
                urllib.request.urlopen(f"http://127.0.0.1:{folder.port}/jobs", timeout=10)
            assert no_login.value.code == 401
            browser.delete_all_cookies()
            browser.get(folder.login_url)
            _wait(lambda: browser.execute_script("return document.body.dataset.loaded") == "true", "the folder page")
            row = browser.find_element(By.CSS_SELECTOR, "tr[data-job=clicks]")
            assert "running" in row.text and "totals=3" in row.text
            browser.save_screenshot(str(ARTIFACTS / "folder.png"))
            row.find_element(By.LINK_TEXT, "open").click()
            _wait(lambda: browser.execute_script("return document.body.dataset.loaded") == "true" and "/ui/" in browser.current_url,
                  "the job's dashboard from the folder page")
            assert browser.find_element(By.ID, "job").text == "clicks"
        finally:
            folder.close()
    finally:
        job.stop()


@pytest.mark.slow
def test_the_dashboard_says_the_batch_size_of_a_latency_target_and_the_slo(spark: Any, tmp_path: Path, browser: Any) -> None:
    """Issue 35, item 3: a job run with a latency target reads its log in batches sized for
    it; the status, and the page's summary line, say the read limit, whose it is and
    whether the target is met (the reason in its tooltip). Issue 36: with an SLO (the
    autoscaler recommending only), the summary says it, the share of batches within it
    and the input rate the autoscaler forecast, as the status has them."""
    import threading

    import pyarrow as pa
    from selenium.webdriver.common.by import By

    from keyscale.runtime.control.server import control_api
    from keyscale.runtime.driver.runner import JobRunner, RunOptions
    from keyscale.sources import LocalLog

    log = LocalLog.create(str(tmp_path / "log"), "key string, value long", partitions=2)
    for part in (0, 1):
        log.append(part, pa.table({"key": [f"k{i % 5}" for i in range(100)], "value": list(range(100))}))
    opts = RunOptions(job_file=str(ROOT / "examples" / "log_count.py"), job_dir=str(tmp_path / "job"), parallelism=1,
                      trigger_interval="300 milliseconds", args={"log": log.uri, "output": str(tmp_path / "out")}, latency_target="5 s",
                      scaling="auto", autoscaler_mode="recommend", slo="latency=10min")
    runner = JobRunner(opts, serve=control_api(opts))
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()
    jd = JobDir(str(tmp_path / "job"))
    try:
        _wait(lambda: len(runner.summary.batches) >= 3, "three batches")
        size = runner.live_status()["batch_size"]
        assert size["target_seconds"] == 5.0 and size["limited_by"] == "latency target" and size["partitions"] == 2
        assert size["records"] == 2 * size["records_per_partition"] and size["reason"]
        browser.get(call(jd, "POST", "/ui/token")["url"])
        _wait(lambda: browser.execute_script("return document.body.dataset.loaded") == "true", "the page to load")
        summary = browser.find_element(By.ID, "summary")
        assert re.search(r"read limit \S+ records \(latency target\) for the 5 s latency target: (met|not met)", summary.text), summary.text
        assert summary.get_attribute("title")  # the reason
        scaling = runner.live_status()["scaling"]
        assert scaling["slo"] == "latency=600s" and scaling["slo_attainment"] == 1.0  # records of this minute, well within 10 min
        m = re.search(r"SLO latency=600s: ([\d.]+)% of batches within it · forecast (\S+)/s \((.+?)\)", summary.text)
        assert m is not None and float(m[1]) == 100.0, summary.text
        assert m[3] in {d["forecast"]["method"] for d in scaling["last_decisions"].values() if d.get("forecast")}, summary.text
        assert _browser_errors(browser) == []
    finally:
        runner.stop()
        thread.join(120)


def _browser_errors(browser: Any) -> list[str]:
    """What the page's console reported as failed (a resource that answered 404, a script error)."""
    return [e["message"] for e in browser.get_log("browser") if e["level"] == "SEVERE"]


def _clipped_rows(browser: Any, chart: str) -> int:
    """How many pixel rows of the chart's plot height have ink in the canvas's first two
    columns: a y-axis label wider than its axis is cut off there (the `0,000` of issue 33)."""
    return int(browser.execute_script("""
        const u = charts[arguments[0]], c = u.ctx.canvas, r = devicePixelRatio;
        const px = u.ctx.getImageData(0, Math.round(u.bbox.top), 2, Math.round(u.bbox.height)).data;
        let rows = 0;
        for (let i = 3; i < px.length; i += 8) if (px[i] > 0 || px[i + 4] > 0) rows++;
        return rows;""", chart))


@pytest.mark.slow
def test_the_dashboard_follows_the_jobs_parallelism(spark: Any, tmp_path: Path, browser: Any) -> None:
    """Issue 33, item 6: a job started at -p 4 and rescaled live shows its own parallelism in
    the box (never the page's default), a number being typed is left alone, and pressing
    Rescale without changing it rescales nothing. On the same page: the input-rate axis
    reads 12k/s (not a clipped `0,000`), a file source's backlog is an explicit n/a with the
    reason, and the page has a favicon (no 404)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    inp = tmp_path / "in"
    write_events(inp, files=3, rows=30_000, keys=300)  # tens of thousands of records/s: five-digit rates
    events = spark.readStream.schema("key string, value long, ts timestamp").option("maxFilesPerTrigger", 1).parquet(str(inp))
    job = (ks.stream(events).key_by("key").aggregate(uid="totals", count=ks.aggregates.count())
           .sink(ks.sinks.ParquetSink(str(tmp_path / "out"))).start(str(tmp_path / "job"), 4, name="wide", trigger_interval="300 milliseconds"))
    jd = JobDir(str(tmp_path / "job"))
    field = lambda: browser.find_element(By.ID, "parallelism")  # noqa: E731
    try:
        _wait(lambda: job.status()["last_checkpoint"] == 2, "three batches")
        browser.get(call(jd, "POST", "/ui/token")["url"])
        _wait(lambda: browser.execute_script("return document.body.dataset.loaded") == "true", "the page to load")
        assert field().get_attribute("value") == "4"

        rate_labels = browser.execute_script("return charts['chart-rate'].axes[1]._values")
        assert rate_labels and all(re.fullmatch(r"\d+(\.\d)?[kM]?/s", v) for v in rate_labels), rate_labels
        assert any("k/s" in v for v in rate_labels), rate_labels
        assert _clipped_rows(browser, "chart-rate") == 0
        backlog = browser.find_element(By.ID, "chart-backlog")
        assert "n/a" in backlog.text and "does not tell how much input is waiting" in backlog.text
        assert not backlog.find_elements(By.TAG_NAME, "canvas")
        icon = browser.find_element(By.CSS_SELECTOR, "link[rel=icon]").get_attribute("href")
        assert browser.execute_script("return fetch(arguments[0]).then((r) => r.status + ' ' + r.headers.get('content-type'))", icon) == "200 image/svg+xml"
        assert _browser_errors(browser) == []
        ARTIFACTS.mkdir(exist_ok=True)
        browser.save_screenshot(str(ARTIFACTS / "dashboard-p4.png"))

        # A live rescale from elsewhere (the CLI, the autoscaler): the box follows the job.
        job.rescale(3)
        write_events(inp, files=1, rows=30_000, keys=300, first=3)
        _wait(lambda: job.status()["last_checkpoint"] == 3, "the rescale")
        _wait(lambda: field().get_attribute("value") == "3", "the box to show 3")

        # A number being typed survives the page's refreshes.
        field().send_keys(Keys.BACKSPACE, "6")
        seen = browser.execute_script("return Number(document.body.dataset.refreshes)")
        _wait(lambda: browser.execute_script("return Number(document.body.dataset.refreshes)") >= seen + 2, "two refreshes")
        assert field().get_attribute("value") == "6"
        browser.find_element(By.ID, "job").click()  # focus elsewhere: still the user's number
        _wait(lambda: browser.execute_script("return Number(document.body.dataset.refreshes)") >= seen + 3, "a refresh")
        assert field().get_attribute("value") == "6"

        # A fresh page, Rescale pressed without a change: nothing is requested.
        browser.refresh()
        _wait(lambda: browser.execute_script("return document.body.dataset.loaded") == "true", "the page to load again")
        assert field().get_attribute("value") == "3"
        browser.find_element(By.ID, "rescale").click()
        _wait(lambda: browser.find_element(By.ID, "result").text != "", "the page's answer")
        assert browser.find_element(By.ID, "result").text == "the job already runs at parallelism 3: nothing to rescale"
        assert job.status()["pending_rescale"] is None
        write_events(inp, files=1, rows=30_000, keys=300, first=4)
        _wait(lambda: job.status()["last_checkpoint"] == 4, "one more batch")
        assert job.status()["operators"]["totals"]["parallelism"] == 3
    finally:
        job.stop()


@pytest.mark.slow
@pytest.mark.parametrize("where", ["local", pytest.param("s3", marks=pytest.mark.s3)])
def test_the_dashboard_looks_up_a_key(spark: Any, tmp_path: Path, browser: Any, where: str, request: pytest.FixtureRequest) -> None:
    """Issue 37, item 6: each keyed operator has a key lookup box; its answer is the model's,
    computed from the records written (the key's count and sum, its key group by Spark's
    ``pmod(hash(key), M)``, the batch of the last file read), a key without state says so,
    the box and its answer survive the page's refreshes, and the console stays clean. The
    job directory on local disk, and on the S3 server (the input and output stay local)."""
    import json

    import pandas as pd
    from selenium.webdriver.common.by import By

    files, m = 2, 32
    job_dir = f"{request.getfixturevalue('s3_bucket')}/job" if where == "s3" else str(tmp_path / "job")
    inp = tmp_path / "in"
    write_events(inp, files=files, rows=1000, keys=50)
    # The model, from the records written: each key's count and sum, its key group as Spark's
    # own hash gives it, and the batch of the last file (one file a batch).
    records = pd.concat(pd.read_parquet(f) for f in sorted(inp.glob("*.parquet")))
    model = {k: {"count": int(r["count"]), "total": int(r["sum"])} for k, r in records.groupby("key")["value"].agg(["count", "sum"]).iterrows()}
    key_group = {r["key"]: r["kg"] for r in spark.createDataFrame([("k42",), ("k7",), ("nobody",)], "key string")
                 .selectExpr("key", f"pmod(hash(key), {m}) AS kg").collect()}
    batch = files - 1
    events = spark.readStream.schema("key string, value long, ts timestamp").option("maxFilesPerTrigger", 1).parquet(str(inp))
    job = (ks.stream(events).key_by("key").aggregate(uid="totals", count=ks.aggregates.count(), total=ks.aggregates.sum("value"))
           .sink(ks.sinks.ParquetSink(str(tmp_path / "out")))
           .start(job_dir, 2, name="lookups", trigger_interval="300 milliseconds", max_parallelism=m))
    jd = JobDir(job_dir)
    try:
        _wait(lambda: job.status()["last_checkpoint"] == batch, "two batches")
        browser.get(call(jd, "POST", "/ui/token")["url"])
        _wait(lambda: browser.execute_script("return document.body.dataset.loaded") == "true", "the page to load")
        form = browser.find_element(By.CSS_SELECTOR, "[data-operator=totals] form.lookup")
        answer = lambda: form.find_element(By.CLASS_NAME, "answer")  # noqa: E731

        def look_up(key: str) -> None:
            box = form.find_element(By.NAME, "key")
            box.clear()
            box.send_keys(key)
            form.find_element(By.TAG_NAME, "button").click()
            _wait(lambda: answer().find_elements(By.CLASS_NAME, "value"), f"the answer for {key}")  # the click cleared the last one

        for key in ("k42", "k7"):
            assert key in model
            look_up(key)
            assert "found" in answer().get_attribute("class")
            assert answer().find_element(By.CLASS_NAME, "batch").text == f"batch {batch}"
            assert answer().find_element(By.CLASS_NAME, "key-group").text == f"key group {key_group[key]}"
            assert json.loads(answer().find_element(By.CLASS_NAME, "value").text) == model[key], key
        # Refreshes redraw the strip, not the box: the key and its answer stay.
        seen = browser.execute_script("return Number(document.body.dataset.refreshes)")
        _wait(lambda: browser.execute_script("return Number(document.body.dataset.refreshes)") >= seen + 2, "two refreshes")
        assert form.find_element(By.NAME, "key").get_attribute("value") == "k7"
        assert json.loads(answer().find_element(By.CLASS_NAME, "value").text) == model["k7"]

        assert "nobody" not in model
        look_up("nobody")
        assert "missing" in answer().get_attribute("class")
        assert answer().find_element(By.CLASS_NAME, "batch").text == f"batch {batch}"
        assert answer().find_element(By.CLASS_NAME, "key-group").text == f"key group {key_group['nobody']}"
        said = answer().find_element(By.CLASS_NAME, "value").text
        assert "'nobody'" in said and "has no state" in said and "'totals'" in said and f"checkpoint {batch}" in said, said
        assert _browser_errors(browser) == []
        ARTIFACTS.mkdir(exist_ok=True)
        browser.save_screenshot(str(ARTIFACTS / f"dashboard-lookup-{where}.png"))
    finally:
        job.stop()


def test_the_folder_page_says_which_jobs_failed(tmp_path: Path) -> None:
    ok, bad = JobDir(str(tmp_path / "a")), JobDir(str(tmp_path / "nested" / "b"))
    ok.claim("a", None, 128)
    bad.claim("b", None, 128)
    bad.write_status({"state": "failed", "last_error": {"message": "ValueError: boom", "traceback": "", "batch": 3, "time_ms": 0}})
    rows = {r["job"]: r for r in folder_rows(str(tmp_path))}
    assert rows["a"]["state"] == "stopped" and rows["a"]["error"] is None
    assert rows["b"]["state"] == "failed" and rows["b"]["error"] == "ValueError: boom"


def test_a_login_link_works_once() -> None:
    logins = Logins(ttl=60)
    token = logins.issue()
    session = logins.redeem(token)
    assert session is not None and logins.redeem(token) is None and logins.redeem("forged") is None
    headers = {"Host": "127.0.0.1:9", "Cookie": f"keyscale_session={session}", "Content-Type": "application/json"}
    assert check_request("GET", headers, 9, "secret", logins.sessions) is None
    # A POST from the page needs the CSRF header; a cookie of another run, or none, is refused.
    assert check_request("POST", headers, 9, "secret", logins.sessions) == (403, "a dashboard request must carry the X-Keyscale-Request header")
    assert check_request("POST", {**headers, "X-Keyscale-Request": "1"}, 9, "secret", logins.sessions) is None
    assert check_request("GET", {**headers, "Cookie": "keyscale_session=old"}, 9, "secret", logins.sessions)[0] == 401  # type: ignore[index]
    assert check_request("GET", {**headers, "Host": "evil.example:9"}, 9, "secret", logins.sessions)[0] == 403  # type: ignore[index]


def test_an_expired_login_link_is_refused() -> None:
    logins = Logins(ttl=0.0)
    token = logins.issue()
    time.sleep(0.01)
    assert logins.redeem(token) is None


def test_the_dashboard_is_vendored() -> None:
    page = static_file("index.html")
    assert page is not None
    html = page[0].decode()
    assert "http://" not in html and "https://" not in html  # no CDN: every file is served by the job
    for name in ("uPlot.iife.min.js", "uPlot.min.css", "dashboard.js", "dashboard.css", "uPlot.LICENSE"):
        assert static_file(name) is not None, name
