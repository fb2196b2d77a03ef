"""Sizing notices for frames: what rides in a request, and how the rest is split."""

from __future__ import annotations

import itertools
import logging

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrpc.agent.notices import (
    FRAME_NOTICE_BYTES,
    REQUEST_NOTICE_BYTES,
    Notice,
    fits_a_request,
    in_frames,
)


def packed(notices: list[Notice]) -> int:
    return sum(len(msgpack.packb(notice)) for notice in notices)


def test_a_few_small_notices_ride_in_a_request_and_many_do_not() -> None:
    deleted = ["rref.fork_deleted", 0, 598, 0, 599]  # 25 bytes packed
    assert fits_a_request([deleted] * 3)
    most = REQUEST_NOTICE_BYTES // packed([deleted])
    assert fits_a_request([deleted] * most)
    assert not fits_a_request([deleted] * (most + 1))
    assert not fits_a_request([deleted, ["k", object()]])  # in_frames says why


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(st.binary(max_size=20_000), max_size=60))
def test_runs_keep_every_notice_in_order_each_within_a_frame(payloads: list[bytes]) -> None:
    notices = [["key", i, payload] for i, payload in enumerate(payloads)]
    runs = in_frames("peer", notices)
    assert [n for run in runs for n in run] == notices
    assert all(run and packed(run) <= FRAME_NOTICE_BYTES for run in runs)
    # each run but the last was closed by a notice that would not fit in it
    for run, following in itertools.pairwise(runs):
        assert packed(run) + packed(following[:1]) > FRAME_NOTICE_BYTES


def test_a_notice_that_can_never_leave_is_left_out_and_named(
    caplog: pytest.LogCaptureFixture,
) -> None:
    huge = ["key", "x" * FRAME_NOTICE_BYTES]
    with caplog.at_level(logging.ERROR, logger="asyncrpc.agent"):
        runs = in_frames("w3", [["key", 1], huge, ["key", object()], ["key", 2]])
    assert runs == [[["key", 1], ["key", 2]]]
    assert "for 'w3' dropped: 49160 bytes packed, more than a frame's 49152" in caplog.text
    assert "for 'w3' dropped: msgpack cannot pack it" in caplog.text
    assert in_frames("w3", []) == []
