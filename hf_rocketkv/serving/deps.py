"""The optional ``serve`` extra (FastAPI, uvicorn, prometheus-client): imported only when a server is built."""

from __future__ import annotations

import importlib

from .errors import ServeDependencyError

SERVE_MODULES = ("fastapi", "uvicorn", "prometheus_client")
INSTALL_HINT = "pip install hf_rocketkv[serve]"


def require_serve_deps() -> None:
    """Raise ``ServeDependencyError`` naming the missing packages and the install command."""
    missing = []
    for name in SERVE_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise ServeDependencyError(
            f"the HTTP server needs {', '.join(missing)}, which is not installed: run `{INSTALL_HINT}`"
        )
