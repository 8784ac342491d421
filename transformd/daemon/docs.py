"""``/docs`` (Swagger UI) and ``/redoc`` served from the installed packages: they work on an offline node.

FastAPI's own pages load their JavaScript and CSS from a public CDN, so on a node without internet
access ``/docs`` is a blank page. Here the pages reference only this daemon's URLs, and the assets
are served from the files the ``fastapi-offline`` wheel ships (Swagger UI 5, ReDoc 2, a favicon)
under :data:`STATIC_URL`. The Swagger UI validator badge (which calls an external service) is off.

If the assets are not installed, ``/docs`` says so and points at ``/openapi.json`` instead.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from fastapi import FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import HTMLResponse
from starlette.requests import Request
from starlette.staticfiles import StaticFiles

__all__ = ["DOCS_URL", "REDOC_URL", "STATIC_URL", "install_docs", "static_dir"]

DOCS_URL = "/docs"
REDOC_URL = "/redoc"
#: Where the Swagger UI / ReDoc assets are served.
STATIC_URL = "/docs/static"
#: Files of the asset package the pages use.
ASSETS = ("swagger-ui-bundle.js", "swagger-ui.css", "redoc.standalone.js", "favicon.png")


def static_dir() -> Path | None:
    """The directory of the Swagger UI / ReDoc assets (the ``fastapi_offline`` package's ``static/``), or None."""
    spec = importlib.util.find_spec("fastapi_offline")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "static"
    return path if all((path / name).is_file() for name in ASSETS) else None


def install_docs(app: FastAPI) -> None:
    """Add ``/docs``, its OAuth2 redirect page, ``/redoc`` and the assets to ``app`` (created with
    ``docs_url=None, redoc_url=None``)."""
    assets = static_dir()
    openapi_url = app.openapi_url or "/openapi.json"
    if assets is not None:
        app.mount(STATIC_URL, StaticFiles(directory=str(assets)), name="docs-static")

    @app.get(DOCS_URL, include_in_schema=False)
    async def swagger_ui(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        if assets is None:
            return _missing(root + openapi_url)
        return get_swagger_ui_html(
            openapi_url=root + openapi_url,
            title=f"{app.title} - API",
            swagger_js_url=f"{root}{STATIC_URL}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{STATIC_URL}/swagger-ui.css",
            swagger_favicon_url=f"{root}{STATIC_URL}/favicon.png",
            oauth2_redirect_url=root + (app.swagger_ui_oauth2_redirect_url or f"{DOCS_URL}/oauth2-redirect"),
            swagger_ui_parameters={**(app.swagger_ui_parameters or {}), "validatorUrl": None},
        )

    @app.get(app.swagger_ui_oauth2_redirect_url or f"{DOCS_URL}/oauth2-redirect", include_in_schema=False)
    async def swagger_ui_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    @app.get(REDOC_URL, include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        if assets is None:
            return _missing(root + openapi_url)
        return get_redoc_html(
            openapi_url=root + openapi_url,
            title=f"{app.title} - API",
            redoc_js_url=f"{root}{STATIC_URL}/redoc.standalone.js",
            redoc_favicon_url=f"{root}{STATIC_URL}/favicon.png",
            with_google_fonts=False,
        )


def _missing(openapi_url: str) -> HTMLResponse:
    return HTMLResponse(
        "<!DOCTYPE html><html><head><title>transformd API</title></head><body><p>The Swagger UI assets are not "
        "installed (<code>pip install fastapi-offline</code>). The OpenAPI schema is at "
        f'<a href="{openapi_url}">{openapi_url}</a>.</p></body></html>'
    )
