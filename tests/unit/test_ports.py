"""The tcp port a worker listens on: ``listen_port`` or ``ASYNCRPC_LISTEN_PORT``, plus
torchrun's ``LOCAL_RANK``; bad values are refused naming the variable."""

from __future__ import annotations

import pytest

from asyncrpc.api import _int_from_env, _listen_port, _tcp_stripes


def test_any_free_port_unless_one_is_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ASYNCRPC_LISTEN_PORT", raising=False)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert _listen_port(None) == 0
    assert _listen_port(0) == 0


def test_the_port_is_the_base_plus_the_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert _listen_port(29600) == 29600
    monkeypatch.setenv("ASYNCRPC_LISTEN_PORT", "29700")
    assert _listen_port(None) == 29700
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert _listen_port(None) == 29702
    assert _listen_port(29600) == 29602  # the argument wins over the environment


def test_bad_ports_are_refused_naming_what_is_wrong(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCRPC_LISTEN_PORT", "http")
    with pytest.raises(ValueError, match="ASYNCRPC_LISTEN_PORT='http' is not a port number"):
        _listen_port(None)
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(ValueError, match="listen_port 65535 \\+ LOCAL_RANK is 65536"):
        _listen_port(65535)
    monkeypatch.setenv("ASYNCRPC_METRICS_PORT", "nine")
    with pytest.raises(ValueError, match="ASYNCRPC_METRICS_PORT='nine' is not a port number"):
        _int_from_env("ASYNCRPC_METRICS_PORT", "a port number")


def test_tcp_stripes_come_from_the_argument_then_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("ASYNCRPC_TCP_STRIPES", raising=False)
    assert _tcp_stripes(None) == 2
    monkeypatch.setenv("ASYNCRPC_TCP_STRIPES", "0")
    assert _tcp_stripes(None) == 0
    assert _tcp_stripes(3) == 3  # the argument wins over the environment
    monkeypatch.setenv("ASYNCRPC_TCP_STRIPES", "two")
    with pytest.raises(ValueError, match="ASYNCRPC_TCP_STRIPES"):
        _tcp_stripes(None)
