"""One self-contained HTML page from a :class:`~spec_batch.reports.pages.Page` (a jinja2 template, autoescaped).

The page loads nothing: styles are inline, charts are inline SVG, and its Content-Security-Policy forbids any
fetch, so it reads the same offline, from a mail attachment or an artifact store.
"""

from __future__ import annotations

from functools import lru_cache

from jinja2 import Environment, PackageLoader, StrictUndefined, select_autoescape

from .pages import Page


@lru_cache(maxsize=1)
def _environment() -> Environment:
    return Environment(
        loader=PackageLoader("spec_batch.reports", "templates"),
        autoescape=select_autoescape(["html", "j2"]),
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )


def render(page: Page) -> str:
    return _environment().get_template("report.html.j2").render(page=page)
