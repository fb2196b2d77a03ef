"""A silent tcp peer is dropped by the kernel: the socket options each tcp link sets,
computed (``silence_options``) and read back from a real socket."""

from __future__ import annotations

import socket

import pytest

from asyncrpc.transport.liveness import detect_silence, silence_options

TCP = socket.IPPROTO_TCP


def named(bound: float) -> dict[str, int]:
    names = {
        (socket.SOL_SOCKET, socket.SO_KEEPALIVE): "keepalive",
        (TCP, socket.TCP_KEEPIDLE): "idle",
        (TCP, socket.TCP_KEEPINTVL): "interval",
        (TCP, socket.TCP_KEEPCNT): "count",
        (TCP, socket.TCP_USER_TIMEOUT): "user_timeout_ms",
    }
    return {names[level, option]: value for level, option, value in silence_options(bound)}


@pytest.mark.parametrize(
    ("bound", "expected"),
    [
        (10.0, {"idle": 5, "interval": 1, "count": 5, "user_timeout_ms": 10000}),
        (60.0, {"idle": 30, "interval": 6, "count": 5, "user_timeout_ms": 60000}),
        (3.0, {"idle": 1, "interval": 1, "count": 2, "user_timeout_ms": 3000}),
        (0.5, {"idle": 1, "interval": 1, "count": 1, "user_timeout_ms": 500}),  # whole seconds
    ],
)
def test_probes_start_at_half_the_bound_and_span_it(bound: float, expected: dict[str, int]) -> None:
    options = named(bound)
    assert options == {"keepalive": 1, **expected}
    if bound >= 2:  # without TCP_USER_TIMEOUT the probes alone would end at the bound
        assert options["idle"] + options["count"] * options["interval"] == bound


def test_zero_leaves_the_kernel_defaults() -> None:
    assert silence_options(0) == []


def test_the_options_read_back_from_a_tcp_socket() -> None:
    with socket.socket() as sock:
        detect_silence(sock, 10.0)
        for level, option, value in silence_options(10.0):
            assert sock.getsockopt(level, option) == value
