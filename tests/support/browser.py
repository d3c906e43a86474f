"""Headless Chromium for the dashboard's tests, without any Python browser package.

Chromium (Debian's `chromium`, which `make browser` installs) is run once per page load:
`--dump-dom` prints the DOM after the page's scripts ran for `budget_ms` of virtual time, and
`--screenshot` writes a PNG of the window. Each run gets its own profile in a temporary
folder, deleted afterwards, and runs in its own process group, killed whole on timeout.

`parse_dashboard` reads what the page shows from the attributes that `app.js` sets:
`#stages [data-stage]` cards holding `[data-peer]` replicas (`data-round`, `data-state`,
`data-agrees`, `data-moving`), `#latest-round`, and `#api-status[data-state]`.
"""
from __future__ import annotations

import os
import signal
import struct
import subprocess
import tempfile
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

CHROMIUM = Path("/usr/bin/chromium")
SKIP_REASON = f"{CHROMIUM} is missing: `make browser` installs Debian's chromium (as root)"

_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
          "--disable-background-networking", "--disable-component-update", "--disable-sync",
          "--disable-extensions", "--disable-default-apps", "--mute-audio", "--hide-scrollbars",
          "--disable-crash-reporter", "--no-default-browser-check")


def chromium_available() -> bool:
    return CHROMIUM.is_file() and os.access(CHROMIUM, os.X_OK)


def run_chromium(url: str, *args: str, budget_ms: int = 8000, timeout: float = 60.0) -> str:
    """Run headless Chromium on `url` with extra `args`; returns its stdout. Raises
    RuntimeError (with Chromium's stderr tail) on a non-zero exit or after `timeout` s."""
    with tempfile.TemporaryDirectory(prefix="swarmgrad-chromium-") as tmp:
        env = dict(os.environ, HOME=tmp, XDG_CONFIG_HOME=f"{tmp}/config", XDG_CACHE_HOME=f"{tmp}/cache")
        command = [str(CHROMIUM), *_FLAGS, f"--user-data-dir={tmp}/profile",
                   f"--virtual-time-budget={budget_ms}", *args, url]
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                                cwd=tmp, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the group this call created, nothing else
            out, err = proc.communicate()
            raise RuntimeError(f"chromium took more than {timeout:.0f} s on {url}: "
                               f"{err.decode(errors='replace')[-2000:]}") from None
        if proc.returncode != 0:
            raise RuntimeError(f"chromium exited {proc.returncode} on {url}: "
                               f"{err.decode(errors='replace')[-2000:]}")
        return out.decode(errors="replace")


def dump_dom(url: str, budget_ms: int = 8000, timeout: float = 60.0) -> str:
    """The page's DOM as HTML after its scripts ran for `budget_ms` ms of virtual time."""
    return run_chromium(url, "--dump-dom", budget_ms=budget_ms, timeout=timeout)


def screenshot(url: str, path: Path, size: tuple[int, int] = (1366, 768), budget_ms: int = 8000,
               timeout: float = 60.0) -> Path:
    """Save a PNG of the page in a window of `size` pixels to `path`; returns `path`."""
    path = Path(path).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    run_chromium(url, f"--screenshot={path}", f"--window-size={size[0]},{size[1]}",
                 budget_ms=budget_ms, timeout=timeout)
    if not path.is_file():
        raise RuntimeError(f"chromium wrote no screenshot to {path}")
    return path


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk; ValueError if `path` is not a PNG."""
    head = Path(path).read_bytes()[:24]
    if head[:8] != b"\x89PNG\r\n\x1a\n" or head[12:16] != b"IHDR":
        raise ValueError(f"{path} is not a PNG")
    return struct.unpack(">II", head[16:24])


@dataclass
class DashboardView:
    """What the dumped page shows. `stages` maps a stage to its replicas in page order,
    each replica's data-* attributes by name (without the `data-` prefix)."""
    stages: dict[int, dict[str, dict[str, str]]] = field(default_factory=dict)
    stage_order: list[int] = field(default_factory=list)
    latest_round: str | None = None
    api_state: str | None = None
    api_text: str = ""
    js_error: str | None = None
    texts: dict[str, str] = field(default_factory=dict)  # text of every element with an id


_VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source",
         "track", "wbr"}


class _Parser(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.view = DashboardView()
        self.stack: list[tuple[str, dict[str, str]]] = []  # open elements: tag, attributes
        self.text_ids: list[tuple[str, list[str]]] = []

    def _inside(self, key: str, value: str | None = None) -> dict[str, str] | None:
        for _, attrs in reversed(self.stack):
            if key in attrs and (value is None or attrs[key] == value):
                return attrs
        return None

    def handle_starttag(self, tag: str, raw: list[tuple[str, str | None]]) -> None:
        attrs = {key: value or "" for key, value in raw}
        if tag == "body":
            self.view.js_error = attrs.get("data-js-error")
        if "data-stage" in attrs and self._inside("id", "stages"):
            stage = int(attrs["data-stage"])
            self.view.stages.setdefault(stage, {})
            self.view.stage_order.append(stage)
        if "data-peer" in attrs and self._inside("id", "stages"):
            card = self._inside("data-stage")
            assert card is not None, f"replica {attrs['data-peer']} outside a stage card"
            self.view.stages[int(card["data-stage"])][attrs["data-peer"]] = {
                key[5:]: value for key, value in attrs.items() if key.startswith("data-")}
        if attrs.get("id") == "api-status":
            self.view.api_state = attrs.get("data-state")
        if tag in _VOID:
            return
        self.stack.append((tag, attrs))
        if "id" in attrs:
            self.text_ids.append((attrs["id"], []))

    def handle_endtag(self, tag: str) -> None:
        if tag in _VOID:
            return
        while self.stack:
            open_tag, attrs = self.stack.pop()
            if "id" in attrs:
                ident, parts = self.text_ids.pop()
                self.view.texts[ident] = " ".join("".join(parts).split())
            if open_tag == tag:
                break

    def handle_data(self, data: str) -> None:
        for _, parts in self.text_ids:
            parts.append(data)


def parse_dashboard(dom: str) -> DashboardView:
    """Read the stages, replicas, latest round and API status from a dumped dashboard DOM."""
    parser = _Parser()
    parser.feed(dom)
    parser.close()
    view = parser.view
    view.latest_round = view.texts.get("latest-round")
    view.api_text = view.texts.get("api-status", "")
    return view
