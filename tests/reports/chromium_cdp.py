"""Open a local page in headless Chromium and inspect it over the DevTools protocol (the report tests' browser).

The protocol runs over ``--remote-debugging-pipe`` (JSON messages ended by a NUL byte on file descriptors 3 and
4), so no port, no websocket library and no network are involved. Debian's ``chromium`` package is the browser
(scripts/setup.sh installs it); tests skip with the reason when it is missing.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--remote-debugging-pipe",
]


def _above_4(fd: int) -> int:
    """The same pipe end on a descriptor above 4 (the original is closed)."""
    high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
    os.close(fd)
    return high


def chromium_path() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


@dataclass
class PageReport:
    console_errors: list[str]  # console.error calls, uncaught exceptions and browser log errors (CSP, loads)
    boxes: list[dict[str, Any]]  # one per `selector` match: key, width, height, svg size, text
    screenshot: Path
    events: list[dict[str, Any]] = field(default_factory=list)


class Chromium:
    """One headless browser with a fresh profile; use as a context manager."""

    def __init__(self, *, timeout_s: float = 30.0, window: tuple[int, int] = (1280, 900)) -> None:
        path = chromium_path()
        if path is None:
            raise FileNotFoundError("chromium is not installed (scripts/setup.sh installs Debian's package)")
        self.timeout_s = timeout_s
        self._profile = tempfile.mkdtemp(prefix="spec-batch-chromium-")
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()
        to_browser_r, from_browser_w = _above_4(to_browser_r), _above_4(from_browser_w)  # 3 and 4 are taken below

        # The browser reads commands on fd 3 and writes replies on fd 4; bash moves the pipe ends there
        # (thread-safe, unlike a preexec_fn) and execs the browser.
        redirect = f'exec "$0" "$@" 3<&{to_browser_r} 4>&{from_browser_w} {to_browser_r}<&- {from_browser_w}>&-'
        self._proc = subprocess.Popen(
            [
                "/bin/bash",
                "-c",
                redirect,
                path,
                *CHROMIUM_FLAGS,
                f"--user-data-dir={self._profile}",
                f"--window-size={window[0]},{window[1]}",
                "about:blank",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            pass_fds=(to_browser_r, from_browser_w),
        )
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._buffer = b""
        self._next_id = 0
        self._session: str | None = None
        self.events: list[dict[str, Any]] = []

    def __enter__(self) -> Chromium:
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self._session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        for domain in ("Page", "Runtime", "Log"):
            self.call(f"{domain}.enable")
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.call("Browser.close", session=False)
        except Exception:
            pass
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        for fd in (self._to_browser, self._from_browser):
            os.close(fd)
        shutil.rmtree(self._profile, ignore_errors=True)

    # ------------------------------------------------------------ protocol

    def _read_message(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._from_browser], [], [], left)[0]:
                raise TimeoutError("no message from chromium in time")
            chunk = os.read(self._from_browser, 1 << 20)
            if not chunk:
                raise ConnectionError(f"chromium exited (code {self._proc.poll()})")
            self._buffer += chunk
        raw, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(raw)

    def call(self, method: str, *, session: bool = True, **params: Any) -> dict[str, Any]:
        """Sends one command and returns its result; events that arrive meanwhile are kept in `events`."""
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params}
        if session and self._session is not None:
            message["sessionId"] = self._session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + self.timeout_s
        while True:
            reply = self._read_message(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            if "method" in reply:
                self.events.append(reply)

    def wait_for_event(self, method: str) -> dict[str, Any]:
        for event in self.events:
            if event["method"] == method:
                return event
        deadline = time.monotonic() + self.timeout_s
        while True:
            event = self._read_message(deadline)
            if "method" in event:
                self.events.append(event)
                if event["method"] == method:
                    return event

    # ------------------------------------------------------------ pages

    def console_errors(self) -> list[str]:
        errors = []
        for e in self.events:
            p = e.get("params", {})
            if e["method"] == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                errors.append(" ".join(str(a.get("value", a.get("description", ""))) for a in p.get("args", [])))
            elif e["method"] == "Runtime.exceptionThrown":
                errors.append(p.get("exceptionDetails", {}).get("text", "exception"))
            elif e["method"] == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
                errors.append(p["entry"].get("text", ""))
        return errors

    def open(self, page: Path, *, selector: str, screenshot: Path) -> PageReport:
        """Loads a local file, measures every element matching `selector`, saves a full-page PNG."""
        self.events.clear()
        self.call("Page.navigate", url=page.resolve().as_uri())
        self.wait_for_event("Page.loadEventFired")
        script = (
            f"JSON.stringify([...document.querySelectorAll({json.dumps(selector)})].map(e => {{ const r = e.getBoundingClientRect();"
            " const s = e.querySelector('svg'); const sr = s ? s.getBoundingClientRect() : null;"
            " return {key: e.dataset.chart || '', width: r.width, height: r.height,"
            " svg_width: sr ? sr.width : 0, svg_height: sr ? sr.height : 0,"
            " svg_shapes: s ? s.querySelectorAll('path, use, rect, text').length : 0,"
            " text: e.innerText.trim()}; }))"
        )
        boxes = json.loads(self.call("Runtime.evaluate", expression=script, returnByValue=True)["result"]["value"])
        height = self.call("Runtime.evaluate", expression="document.documentElement.scrollHeight", returnByValue=True)[
            "result"
        ]["value"]
        width = self.call("Runtime.evaluate", expression="document.documentElement.scrollWidth", returnByValue=True)[
            "result"
        ]["value"]
        shot = self.call(
            "Page.captureScreenshot",
            format="png",
            captureBeyondViewport=True,
            clip={"x": 0, "y": 0, "width": width, "height": height, "scale": 1},
        )
        screenshot.parent.mkdir(parents=True, exist_ok=True)
        screenshot.write_bytes(base64.b64decode(shot["data"]))
        return PageReport(self.console_errors(), boxes, screenshot, list(self.events))
