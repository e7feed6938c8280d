"""Report numbers (aggregate) and pages (charts, tables, HTML) from plain report data, without a database."""

from __future__ import annotations

import re
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest
from report_samples import T0, empty_job, history_rows, sample_job

from spec_batch.reports import aggregate
from spec_batch.reports.html import render
from spec_batch.reports.pages import history_page, job_section, jobs_page
from spec_batch.store.report_queries import BaselinePoint, RequestPoint

NOW = datetime(2026, 6, 1, tzinfo=UTC)
JOB_CHARTS = ["acceptance-by-position", "accepted-length", "requests-paid", "throughput", "baseline"]


def point(i: int, **kw) -> RequestPoint:
    base = dict(
        request_id=i,
        custom_id=f"r{i}",
        line_number=i,
        status="completed",
        output_tokens=None,
        draft_tokens=None,
        accepted_tokens=None,
        target_forwards=None,
        accepted_length_histogram=None,
        drafted_per_position=None,
        accepted_per_position=None,
        wall_s=None,
        started_at=None,
        completed_at=None,
    )
    return RequestPoint(**{**base, **kw})


def test_acceptance_by_position_sums_lists_of_any_length():
    rows = [
        point(1, drafted_per_position=[4, 4, 2], accepted_per_position=[3, 1, 0]),
        point(2, drafted_per_position=[2], accepted_per_position=[2]),
        point(3),  # not run: no lists
    ]
    got = aggregate.acceptance_by_position(rows)
    assert [(p.position, p.drafted, p.accepted) for p in got] == [(1, 6, 5), (2, 4, 1), (3, 2, 0)]
    assert [p.rate for p in got] == pytest.approx([5 / 6, 0.25, 0.0])
    assert aggregate.acceptance_by_position([point(1)]) == []


def test_accepted_length_counts_sum_histograms_and_trim_trailing_zeros():
    rows = [point(1, accepted_length_histogram=[1, 2, 0, 0]), point(2, accepted_length_histogram=[0, 1, 3])]
    assert aggregate.accepted_length_counts(rows) == [1, 3, 3]


def test_request_rates_and_rankings():
    rows = [
        point(1, output_tokens=40, wall_s=2.0, target_forwards=10, draft_tokens=40, accepted_tokens=30),
        point(2, output_tokens=10, wall_s=2.0, target_forwards=10, draft_tokens=40, accepted_tokens=0),
        point(3, output_tokens=30, wall_s=1.0, target_forwards=30, draft_tokens=0, accepted_tokens=0),
        point(4, status="failed"),  # no tokens, no time: left out
    ]
    rates = aggregate.request_rates(rows)
    assert [r.custom_id for r in rates] == ["r1", "r2", "r3"]
    assert rates[0].tokens_per_s == 20.0 and rates[0].tokens_per_step == 4.0 and rates[0].acceptance_rate == 0.75
    assert rates[2].acceptance_rate is None  # drafted nothing
    assert [r.custom_id for r in aggregate.slowest(rates, 2)] == ["r2", "r1"]
    assert [r.custom_id for r in aggregate.least_accepted(rates, 5)] == ["r2", "r1"]


def test_throughput_spreads_each_request_over_its_own_interval():
    rows = [
        point(1, output_tokens=100, started_at=T0, completed_at=T0 + timedelta(seconds=10)),
        point(2, output_tokens=50, started_at=T0 + timedelta(seconds=5), completed_at=T0 + timedelta(seconds=10)),
    ]
    s = aggregate.throughput_over_time(rows, bins=2)
    assert s is not None and s.bin_width_s == 5.0 and s.bin_starts_s == [0.0, 5.0]
    assert s.tokens_per_s == pytest.approx([10.0, 20.0])  # 50 tokens in [0, 5); 50 + 50 in [5, 10)
    assert sum(r * s.bin_width_s for r in s.tokens_per_s) == pytest.approx(150)
    assert aggregate.throughput_over_time(rows[:1]) is None  # one request: no span to draw

    sampled = point(3, output_tokens=500, started_at=T0, completed_at=T0 + timedelta(seconds=4))
    s = aggregate.throughput_over_time([sampled, *rows], baseline_ids={3}, bins=2)
    assert s.baseline_window_s == (0.0, 4.0)  # shown as a window, its tokens not in the bars
    assert sum(r * s.bin_width_s for r in s.tokens_per_s) == pytest.approx(150)


def test_baseline_rates_pair_each_sampled_request():
    pts = [BaselinePoint(1, "a", 1, 60, 20, 1.0, 60, 2.0), BaselinePoint(2, None, 7, 30, 30, 1.5, 30, 1.0)]
    pairs = aggregate.baseline_rates(pts)
    assert [p.label for p in pairs] == ["a", "line 7"]
    assert [p.speedup for p in pairs] == pytest.approx([2.0, 2 / 3])
    assert aggregate.baseline_request_tokens_per_s(pts) == pytest.approx(90 / 3.0)


def _chart_boxes(html: str) -> list[str]:
    return re.findall(r'<figure class="chart-box ([\w-]+)" data-chart="[\w-]+">(.*?)</figure>', html, re.S)


def test_job_page_is_self_contained_and_every_chart_is_drawn():
    html = render(jobs_page([sample_job("job_a"), sample_job("job_b", seed=1)], now=NOW))
    assert "<script" not in html.lower() and "@import" not in html
    assert not re.findall(r"url\((?!#)", html)  # only references within the page (SVG clip paths)
    urls = set(re.findall(r"""(?:https?:)?//[^\s"'<>)]+""", html))
    assert urls <= {"http://www.w3.org/2000/svg", "http://www.w3.org/1999/xlink"}, urls  # namespaces only
    boxes = _chart_boxes(html)
    assert [k for k, _ in boxes] == JOB_CHARTS * 2
    for key, body in boxes:
        assert body.count("<svg") == 1, key
        assert 'class="empty"' not in body, key
    ids = re.findall(r'\sid="([^"]+)"', html)
    assert len(ids) == len(set(ids)), "element ids repeat across the page's SVGs"
    # titles and axis labels are text in the SVG (svg.fonttype none), readable and searchable
    for words in (
        "Acceptance rate by draft position",
        "position in the draft",
        "share of steps (%)",
        "Which requests paid?",
        "tokens per step (output tokens / target forwards)",
        "Throughput over the job",
        "output tokens/s",
        "Baseline sample, request by request",
        "with speculation",
        "without speculation",
        "Jobs in this report",
        "Slowest requests",
        "Least-accepted requests",
    ):
        assert words in html, words


def test_paid_chart_splits_requests_at_the_baseline():
    data = sample_job()
    base = aggregate.baseline_request_tokens_per_s(data.baseline)
    rates = aggregate.request_rates(data.requests)
    paid = sum(r.tokens_per_s >= base for r in rates)
    html = render(jobs_page([data], now=NOW))
    assert 0 < paid < len(rates)  # the sample has both kinds
    assert f"faster than without speculation ({paid})" in html
    assert f"slower than without speculation ({len(rates) - paid})" in html


def test_a_job_with_nothing_to_draw_says_why_in_every_box():
    section = job_section(empty_job())
    assert [c.key for c in section.charts] == JOB_CHARTS
    assert all(c.svg is None and c.caption for c in section.charts)
    html = render(jobs_page([empty_job()], now=NOW))
    assert html.count('class="empty"') >= len(JOB_CHARTS) and "<svg" not in html


def test_summary_and_tables_escape_user_text():
    data = sample_job()
    first = replace(data.requests[0], custom_id="<b>evil</b>", wall_s=100.0)  # the slowest request
    html = render(jobs_page([replace(data, requests=[first, *data.requests[1:]])], now=NOW))
    assert "&lt;b&gt;evil&lt;/b&gt;" in html and "<b>evil</b>" not in html
    summary = dict(job_section(data).summary)
    assert summary["speedup"] == "1.60×" and summary["status"] == "completed"
    assert summary["baseline"].startswith("50.0 tokens/s without speculation (8 request(s) sampled)")


def test_history_page_colours_jobs_by_target_and_drafter():
    rows = history_rows()
    page = history_page(rows, now=NOW, since=T0)
    html = render(page)
    assert [c.key for c in page.charts] == ["history-speedup", "history-tokens-per-s"]
    assert all(c.svg is not None for c in page.charts)
    for label in (
        "default + ngram",
        "default + suffix",
        "Speedup per job over time",
        "job created (UTC)",
        "Throughput per job over time",
        "no gain (1×)",
    ):
        assert label in html, label
    assert len(page.tables[0].rows) == len(rows) and page.tables[0].rows[0][1] == rows[-1]["job_id"]  # newest first
    empty = history_page([], now=NOW, since=None)
    assert all(c.svg is None for c in empty.charts)


def _legend_colours(html: str, chart_id: str) -> dict[str, str]:
    """{label: stroke colour} of a chart's legend (each entry: a line2d group, then its text)."""
    start = html.index(f'id="{chart_id}-legend_1"')
    legend = html[start : html.index("</svg>", start)]
    pairs = re.findall(r"stroke: (#[0-9a-f]{6}).*?<text[^>]*>([^<]+)</text>", legend, re.S)
    return {label: colour for colour, label in pairs}


def test_history_gives_a_pair_the_same_colour_in_every_chart():
    rows = history_rows()
    # a pair that sorts first and has tokens/s but no speedup: it is in one chart only
    rows += [dict(r, job_id=f"{r['job_id']}_plain", target="a-model", drafter="none", speedup=None) for r in rows[:3]]
    rows.sort(key=lambda r: r["created_at"])
    html = render(history_page(rows, now=NOW, since=None))
    speedup = _legend_colours(html, "history-speedup")
    rates = _legend_colours(html, "history-tokens-per-s")
    assert set(speedup) == {"default + ngram", "default + suffix", "no gain (1×)"}  # and the reference line
    speedup.pop("no gain (1×)")
    assert set(rates) == {"a-model + none", "default + ngram", "default + suffix"}
    assert all(speedup[label] == rates[label] for label in speedup)
    assert len(set(rates.values())) == 3
