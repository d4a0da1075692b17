"""The live D-Cut status page (``GET /dcut/``): a static page and its script, which poll ``/dcut/status`` and
``/dcut/history`` and draw hand-written SVG charts: nothing to build, nothing fetched from elsewhere."""

from __future__ import annotations

from pathlib import Path

from fastapi.responses import FileResponse

PAGE_DIR = Path(__file__).resolve().parent
MEDIA_TYPES = {"index.html": "text/html; charset=utf-8", "app.js": "text/javascript; charset=utf-8"}


def page_file(name: str) -> FileResponse:
    """One of the page's files; ``no-cache`` so an upgraded app serves its new page at once."""
    return FileResponse(PAGE_DIR / name, media_type=MEDIA_TYPES[name], headers={"Cache-Control": "no-cache"})
