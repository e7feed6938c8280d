"""Reports in a real browser: headless Chromium loads the page with no console error, draws every chart in a
non-empty box, and leaves a screenshot under out/ (look at it: out/report-jobs.png, out/report-history.png)."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest
from chromium_cdp import Chromium, chromium_path
from report_samples import empty_job, history_rows, sample_job

from spec_batch.reports.html import render
from spec_batch.reports.pages import history_page, jobs_page

OUT = Path(__file__).resolve().parents[2] / "out"
NOW = datetime(2026, 6, 1, tzinfo=UTC)

pytestmark = pytest.mark.skipif(chromium_path() is None, reason="chromium is not installed (scripts/setup.sh)")


@pytest.fixture(scope="module")
def browser():
    with Chromium() as b:
        yield b


def _assert_charts_drawn(boxes: list[dict], n: int) -> None:
    drawn = [b for b in boxes if b["svg_width"]]
    assert len(drawn) == n, boxes
    for b in drawn:
        assert b["svg_width"] > 300 and b["svg_height"] > 150, b  # laid out at a readable size
        assert b["svg_shapes"] > 20, b  # bars, dots, axes and labels, not an empty frame
        assert b["height"] >= b["svg_height"], b


def test_job_report_in_chromium(browser, tmp_path):
    page = tmp_path / "jobs.html"
    page.write_text(
        render(jobs_page([sample_job("job_a"), sample_job("job_b", seed=1), empty_job()], now=NOW)), encoding="utf-8"
    )
    report = browser.open(page, selector="figure.chart-box", screenshot=OUT / "report-jobs.png")
    assert report.console_errors == []
    assert len(report.boxes) == 15
    _assert_charts_drawn(report.boxes, 10)
    for box in report.boxes[10:]:  # the empty job: each box says why there is no chart
        assert box["svg_width"] == 0 and len(box["text"]) > 40 and box["height"] > 40, box
    assert report.screenshot.stat().st_size > 50_000


def test_history_report_in_chromium(browser, tmp_path):
    page = tmp_path / "history.html"
    page.write_text(render(history_page(history_rows(), now=NOW, since=None)), encoding="utf-8")
    report = browser.open(page, selector="figure.chart-box", screenshot=OUT / "report-history.png")
    assert report.console_errors == []
    _assert_charts_drawn(report.boxes, 2)


def test_the_console_check_catches_errors(browser, tmp_path):
    """The page's Content-Security-Policy blocks scripts and remote loads, and the browser reports each one."""
    page = tmp_path / "bad.html"
    html = render(jobs_page([sample_job()], now=NOW)).replace(
        "</body>", '<script>console.log("ran")</script><img src="https://example.invalid/x.png"></body>'
    )
    page.write_text(html, encoding="utf-8")
    report = browser.open(page, selector="figure.chart-box", screenshot=tmp_path / "bad.png")
    assert any("inline script" in e for e in report.console_errors), report.console_errors
    assert any("example.invalid" in e for e in report.console_errors), report.console_errors
