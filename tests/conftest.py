"""Suite-wide pytest hooks."""

from __future__ import annotations

from asyncrpc import _compiled


def pytest_report_header() -> str:
    active = _compiled.active()
    paths = ", ".join(f"{name}: {'compiled' if c else 'pure Python'}" for name, c in active.items())
    return f"asyncrpc per-message path: {paths}"
