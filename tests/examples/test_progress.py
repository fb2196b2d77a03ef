"""The examples' progress helper (examples/_progress.py): a bar only on a terminal.

The test suite reads the examples' stdout through a pipe, so there the helper must
yield every item and draw nothing; on a terminal it draws a tqdm bar, and still yields
every item.
"""

from __future__ import annotations

import builtins
import importlib.util
import io
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent.parent / "examples"
ITEMS = list(range(25))


def load_progress() -> ModuleType:
    """examples/_progress.py, which the examples import as a top-level module."""
    spec = importlib.util.spec_from_file_location("_progress", EXAMPLES / "_progress.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Terminal(io.StringIO):
    """A stdout that says it is a terminal."""

    def isatty(self) -> bool:
        return True


@pytest.fixture
def progress() -> ModuleType:
    return load_progress()


def test_off_a_terminal_every_item_and_no_bar(
    progress: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    assert list(progress.progress(ITEMS, desc="steps")) == ITEMS
    progress.say("[trainer1] step 25/25  loss 0.1234")
    assert out.getvalue() == "[trainer1] step 25/25  loss 0.1234\n"  # no bar, no escapes


def test_on_a_terminal_every_item_and_a_bar(
    progress: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("tqdm")
    out = Terminal()
    monkeypatch.setattr(sys, "stdout", out)
    assert list(progress.progress(ITEMS, desc="steps")) == ITEMS
    assert "steps: 100%" in out.getvalue() and "25/25" in out.getvalue()
    progress.say("a line")
    assert out.getvalue().endswith(f"{progress.CLEAR_LINE}a line\n")  # in the bar's place


def test_on_a_terminal_no_bar_where_not_shown(
    progress: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = Terminal()
    monkeypatch.setattr(sys, "stdout", out)
    assert list(progress.progress(iter(ITEMS), desc="steps", show=False)) == ITEMS
    assert out.getvalue() == ""


def test_on_a_terminal_without_tqdm_every_item_and_no_bar(
    progress: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_import = builtins.__import__

    def no_tqdm(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "tqdm":
            raise ImportError("No module named 'tqdm'")
        return real_import(name, *args, **kwargs)

    out = Terminal()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(builtins, "__import__", no_tqdm)
    assert list(progress.progress(ITEMS, desc="steps")) == ITEMS
    assert out.getvalue() == ""
