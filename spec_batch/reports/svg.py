"""matplotlib figures to inline SVG: no pyplot state, no fonts or scripts fetched by the viewer.

Text stays text (``svg.fonttype = 'none'``): the browser draws it with a local sans-serif font, so pages are
small and their words searchable. Every element id of a chart is prefixed with the chart's id, so several SVGs
in one page never share an id (matplotlib names the groups of every file alike).
"""

from __future__ import annotations

import io
import re
from collections.abc import Iterator
from contextlib import contextmanager

import matplotlib
from matplotlib.figure import Figure

STYLE = {
    "svg.fonttype": "none",
    "font.family": "sans-serif",
    "font.size": 10,
    "axes.titlesize": 11,
    "axes.titleweight": "bold",
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "legend.frameon": False,
}
WIDTH_IN, HEIGHT_IN = 6.4, 3.4

_PROLOG = re.compile(r"^.*?(?=<svg\b)", re.S)
_METADATA = re.compile(r"\s*<metadata>.*?</metadata>", re.S)  # RDF about the file: nothing a reader sees
_ID = re.compile(r'\b(id)="([^"]+)"')
_URL_REF = re.compile(r"url\(#([^)]+)\)")
_HREF_REF = re.compile(r'\b((?:xlink:)?href)="#([^"]+)"')
_SIZE = re.compile(r'<svg\b([^>]*?)\swidth="[^"]*"\s+height="[^"]*"')


@contextmanager
def figure(width_in: float = WIDTH_IN, height_in: float = HEIGHT_IN) -> Iterator[Figure]:
    """A new figure, with the report's style in force while it is drawn (rcParams are read as artists are made)."""
    with matplotlib.rc_context(STYLE):
        yield Figure(figsize=(width_in, height_in), layout="constrained")


def to_svg(fig: Figure, chart_id: str) -> str:
    """The figure as an ``<svg>`` element sized by its container (its viewBox keeps the aspect ratio)."""
    buf = io.StringIO()
    with matplotlib.rc_context({**STYLE, "svg.hashsalt": "spec-batch"}):  # the same chart, the same bytes
        fig.savefig(buf, format="svg", metadata={"Date": None})
    svg = _METADATA.sub("", _PROLOG.sub("", buf.getvalue(), count=1), count=1)
    # matplotlib names its groups figure_1, axes_1, ... in every file: prefix every id and reference to one
    svg = _ID.sub(rf'\1="{chart_id}-\2"', svg)
    svg = _URL_REF.sub(rf"url(#{chart_id}-\1)", svg)
    svg = _HREF_REF.sub(rf'\1="#{chart_id}-\2"', svg)
    svg = _SIZE.sub(rf'<svg\1 id="{chart_id}" class="chart" role="img"', svg, count=1)
    return svg.strip()
