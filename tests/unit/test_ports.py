"""The tcp port a worker listens on: ``listen_port`` or ``ASYNCRPC_LISTEN_PORT``, plus
torchrun's ``LOCAL_RANK``; bad values are refused naming the variable.  And the port a
job's store is given (``free_port``)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from asyncrpc.api import _int_from_env, _listen_port, _tcp_stripes
from asyncrpc.rendezvous import free_port, store


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


def test_a_store_port_is_free_and_below_the_ports_the_kernel_hands_out() -> None:
    low = store._ephemeral_low()
    for _ in range(20):
        port = free_port()
        assert store.LOWEST_STORE_PORT <= port < low  # no bind(0) nor connect() can take it
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_where_the_kernel_does_not_say_its_range_it_picks_the_port(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(store, "EPHEMERAL_PORTS", str(tmp_path / "missing"))
    assert store._ephemeral_low() == 0
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_when_every_draw_is_taken_the_kernel_picks_the_port(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        only = taken.getsockname()[1]
        monkeypatch.setattr(store, "LOWEST_STORE_PORT", only)
        monkeypatch.setattr(store, "_ephemeral_low", lambda: only + 1)  # one port to draw
        port = free_port(tries=3)
    assert port != only


@pytest.mark.skipif(not socket.has_ipv6, reason="no IPv6 in this Python")
def test_a_store_port_on_an_ipv6_host() -> None:
    try:
        port = free_port("::1")
    except OSError as exc:  # a host without an IPv6 loopback
        pytest.skip(f"no IPv6 loopback here: {exc}")
    with socket.socket(socket.AF_INET6) as sock:
        sock.bind(("::1", port))
