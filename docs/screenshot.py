"""Screenshot pages of the built site with headless Chromium, to look at them as a reader would.

Usage (after ``sphinx-build -W -b html docs docs/_build/html``)::

    python docs/screenshot.py [--out docs/_build/screenshots] [--width 1280] [--height 2000] [PAGE.html ...]

Writes one PNG per page (default: the home page, a how-to page, the config reference and an API page). Needs a
Chromium binary (``chromium``, ``chromium-browser`` or ``google-chrome`` on PATH; on Debian
``apt-get install chromium``); pass its path with ``--chromium`` otherwise.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
PAGES = ("index.html", "how-to/multi-turn.html", "reference/config.html", "reference/api.html")


def find_chromium(given: str | None) -> str:
    """The Chromium binary to run (``given``, else the first known name on PATH)."""
    for name in ([given] if given else ["chromium", "chromium-browser", "google-chrome"]):
        path = shutil.which(name) if name else None
        if path:
            return path
    raise SystemExit("screenshot: no Chromium found (apt-get install chromium, or pass --chromium PATH)")


def screenshot(chromium: str, page: Path, png: Path, width: int, height: int) -> None:
    """One PNG of ``page`` (an HTML file) at ``width`` x ``height`` pixels."""
    png.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    f"--window-size={width},{height}", f"--screenshot={png}", page.as_uri()],
                   check=True, capture_output=True, timeout=120)


def main(argv: list[str] | None = None) -> int:
    """Screenshot the pages named on the command line (default: :data:`PAGES`)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pages", nargs="*", default=list(PAGES), help="pages relative to the built site")
    parser.add_argument("--site", type=Path, default=DOCS / "_build" / "html")
    parser.add_argument("--out", type=Path, default=DOCS / "_build" / "screenshots")
    parser.add_argument("--width", type=int, default=1280)
    parser.add_argument("--height", type=int, default=2000)
    parser.add_argument("--chromium", default=None)
    args = parser.parse_args(argv)
    chromium = find_chromium(args.chromium)
    for name in args.pages:
        page = args.site / name
        if not page.is_file():
            print(f"screenshot: {page} not found (build the site first)", file=sys.stderr)
            return 1
        png = args.out / (name.replace("/", "_").removesuffix(".html") + ".png")
        screenshot(chromium, page, png, args.width, args.height)
        print(png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
