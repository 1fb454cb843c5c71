"""The optional ``serve`` extra (FastAPI, uvicorn, prometheus-client): imported only when a server is built."""

from __future__ import annotations

import importlib
import importlib.util

from ..errors import ServeDependencyError

SERVE_MODULES = ("fastapi", "uvicorn", "prometheus_client")
INSTALL_HINT = "pip install hf_rocketkv[serve]"


def require_serve_deps(load: bool = True) -> None:
    """Raise ``ServeDependencyError`` naming the missing packages and the install command. ``load=False`` only looks
    for them (``importlib.util.find_spec``): the command line's first check, without FastAPI's half second of
    imports before the arguments are read."""
    missing = []
    for name in SERVE_MODULES:
        if not load:
            try:
                found = importlib.util.find_spec(name) is not None
            except (ImportError, ValueError):
                found = False
            if not found:
                missing.append(name)
            continue
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise ServeDependencyError(
            f"the HTTP server needs {', '.join(missing)}, which is not installed: run `{INSTALL_HINT}`"
        )
