"""Unit tests for a Link's flow-control policies (sans-IO): write coalescing, the read gate."""

from __future__ import annotations

import itertools

import pytest

from asyncrpc.transport.flow import COALESCE_WITHIN, FLUSH_PARTS, ReadGate, WriteCoalescer
from asyncrpc.wire.codec import (
    NEED_DATA,
    FrameDecoder,
    Limits,
    encode_entry,
    split_batch,
)
from asyncrpc.wire.messages import ESTABLISHED_KINDS, Kind

SOON = COALESCE_WITHIN / 2  # within a burst
LATER = COALESCE_WITHIN * 2  # after a pause in the same turn


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def writes(clock: Clock) -> WriteCoalescer:
    return WriteCoalescer(clock)


# -- write coalescing ------------------------------------------------------------------


def test_the_first_message_of_a_turn_leaves_at_once(writes: WriteCoalescer) -> None:
    assert not writes.in_turn
    assert writes.send([b"a"]) == [b"a"]
    assert writes.in_turn


def test_a_burst_waits_for_the_end_of_the_turn_and_leaves_in_one_write(
    writes: WriteCoalescer, clock: Clock
) -> None:
    assert writes.send([b"a"]) == [b"a"]
    for part in (b"b", b"c", b"d"):
        clock.advance(SOON)
        assert writes.send([part]) == []
    assert writes.waiting == 3
    assert writes.end_turn() == [b"b", b"c", b"d"]
    assert not writes.in_turn and writes.waiting == 0
    assert writes.end_turn() == []


def test_a_burst_is_measured_from_the_previous_message_not_the_first(
    writes: WriteCoalescer, clock: Clock
) -> None:
    writes.send([b"a"])
    for part in (b"b", b"c", b"d"):  # together 1.5 x COALESCE_WITHIN after the first
        clock.advance(SOON)
        assert writes.send([part]) == []


def test_a_burst_is_strictly_within_its_window() -> None:
    """``within`` seconds after the previous message is a pause, not a burst (an exact
    clock: no float rounding in the subtraction)."""
    now = [0.0]
    writes = WriteCoalescer(lambda: now[0], within=0.5)
    writes.send([b"a"])
    now[0] = 0.25
    assert writes.send([b"b"]) == []  # within the window: waits for its burst
    now[0] = 0.75  # exactly 0.5 after b
    assert writes.send([b"c"]) == [b"b", b"c"]


def test_a_message_after_a_pause_in_the_turn_leaves_at_once_taking_the_burst_along(
    writes: WriteCoalescer, clock: Clock
) -> None:
    writes.send([b"a"])
    clock.advance(SOON)
    writes.send([b"b", b"c"])
    clock.advance(LATER)
    assert writes.send([b"d"]) == [b"b", b"c", b"d"]
    assert writes.waiting == 0


def test_the_first_message_of_the_next_turn_leaves_at_once_however_soon(
    writes: WriteCoalescer, clock: Clock
) -> None:
    writes.send([b"a"])
    writes.end_turn()
    clock.advance(SOON)
    assert writes.send([b"b"]) == [b"b"]


def test_a_long_burst_leaves_every_max_parts(writes: WriteCoalescer, clock: Clock) -> None:
    writes.send([b"first"])
    for i in range(FLUSH_PARTS - 1):
        clock.advance(SOON)
        assert writes.send([bytes([i])]) == []
    clock.advance(SOON)
    written = writes.send([b"last"])
    assert len(written) == FLUSH_PARTS
    assert written[-1] == b"last" and writes.waiting == 0


def test_paused_everything_waits_and_resume_hands_it_back_in_order(
    writes: WriteCoalescer, clock: Clock
) -> None:
    writes.pause()
    for i in range(FLUSH_PARTS + 5):  # past max_parts too: the transport said stop
        clock.advance(LATER)
        assert writes.send([bytes([i])]) == []
    assert writes.end_turn() == []
    assert writes.resume() == [bytes([i]) for i in range(FLUSH_PARTS + 5)]
    assert writes.waiting == 0
    assert writes.send([b"x"]) == [b"x"]


def test_drain_takes_everything_even_paused(writes: WriteCoalescer) -> None:
    writes.pause()
    writes.send([b"a"])
    assert writes.drain() == [b"a"]
    assert writes.resume() == []


def test_starting_paused_holds_writes_until_resumed(clock: Clock) -> None:
    writes = WriteCoalescer(clock, paused=True)
    assert writes.send([b"hello"]) == []
    assert writes.resume() == [b"hello"]


def test_any_sequence_of_events_keeps_every_part_once_and_in_order() -> None:
    """Exhaustively, over short sequences of events: nothing is lost, duplicated or
    reordered, nothing leaves while paused, and nothing waits once resumed at a turn's end."""
    events = ("send soon", "send later", "end turn", "pause", "resume")
    for sequence in itertools.product(events, repeat=6):
        sent, written = replay(sequence)
        assert written == sent, sequence


# -- small messages as the entries of one BATCH frame ----------------------------------


def entry(text: bytes) -> bytes:
    return encode_entry(Kind.NOTICE, {}, text)


def unbatched(parts: list[bytes | memoryview]) -> list[bytes]:
    """The parts written, each BATCH frame among them replaced by its entries' payloads."""
    out: list[bytes] = []
    for part in parts:
        if bytes(part[:2]) != b"\xc1\xa5":  # not a frame's prelude: a test's own part
            out.append(bytes(part))
            continue
        decoder = FrameDecoder(Limits.established(1 << 20))
        decoder.receive_data(part)
        frame = decoder.next_event()
        assert frame is not NEED_DATA and decoder.next_event() is NEED_DATA
        out += [each.payload for each in split_batch(frame.payload, ESTABLISHED_KINDS)]  # type: ignore[union-attr]
    return out


def test_only_a_message_that_would_wait_is_held_as_an_entry(
    writes: WriteCoalescer, clock: Clock
) -> None:
    assert not writes.holds_next()  # the turn's first leaves at once
    writes.send([b"a"])
    clock.advance(SOON)
    assert writes.holds_next()
    clock.advance(LATER)
    assert not writes.holds_next()  # a while since the last: leaves at once
    writes.pause()
    assert writes.holds_next()


def test_a_bursts_entries_leave_as_one_batch_frame_in_their_place(
    writes: WriteCoalescer, clock: Clock
) -> None:
    assert writes.send([b"first"]) == [b"first"]
    for text in (b"b", b"c"):
        clock.advance(SOON)
        assert writes.send_entry(entry(text)) == []
    clock.advance(SOON)
    assert writes.send([b"large"]) == []  # closes the batch before it
    clock.advance(SOON)
    assert writes.send_entry(entry(b"d")) == []
    assert writes.waiting == 3  # the batch of two, the large message, an open batch
    written = writes.end_turn()
    assert len(written) == 3
    assert unbatched(written) == [b"b", b"c", b"large", b"d"]
    assert writes.waiting == 0 and writes.end_turn() == []


def test_a_message_that_leaves_takes_the_open_batch_along_first(
    writes: WriteCoalescer, clock: Clock
) -> None:
    writes.send([b"a"])
    clock.advance(SOON)
    writes.send_entry(entry(b"b"))
    clock.advance(LATER)
    assert unbatched(writes.send([b"c"])) == [b"b", b"c"]


def test_a_long_burst_of_entries_leaves_every_max_parts(
    writes: WriteCoalescer, clock: Clock
) -> None:
    writes.send([b"first"])
    for i in range(FLUSH_PARTS - 1):
        clock.advance(SOON)
        assert writes.send_entry(entry(b"%d" % i)) == []
    clock.advance(SOON)
    written = writes.send_entry(entry(b"last"))
    assert len(written) == 1
    assert unbatched(written) == [b"%d" % i for i in range(FLUSH_PARTS - 1)] + [b"last"]


def test_a_batch_holds_at_most_max_batch_bytes_and_the_next_entry_opens_another(
    writes: WriteCoalescer, clock: Clock
) -> None:
    entries = [entry(bytes([i]) * 300) for i in range(5)]
    writes.max_batch_bytes = 2 * len(entries[0]) + 5  # room for two entries a batch
    assert all(writes.fits_batch(each) for each in entries)
    writes.send([b"first"])
    for each in entries:
        clock.advance(SOON)
        assert writes.send_entry(each) == []
    written = writes.end_turn()
    assert all(len(part) <= 64 + writes.max_batch_bytes for part in written)
    assert [len(unbatched([part])) for part in written] == [2, 2, 1]
    assert unbatched(written) == [bytes([i]) * 300 for i in range(5)]
    assert not writes.fits_batch(entry(b"x" * writes.max_batch_bytes))


def test_paused_entries_wait_and_leave_on_resume_or_drain(clock: Clock) -> None:
    writes = WriteCoalescer(clock, paused=True)
    assert writes.holds_next()
    assert writes.send_entry(entry(b"a")) == [] and writes.end_turn() == []
    assert unbatched(writes.resume()) == [b"a"]
    writes.pause()
    writes.send_entry(entry(b"b"))
    assert unbatched(writes.drain()) == [b"b"]


def replay(sequence: tuple[str, ...]) -> tuple[list[bytes], list[bytes]]:
    """Play ``sequence`` of events on a coalescer (a message sent "soon" or "later" after
    the previous one, a "small" one as an entry whenever it would wait, the end of a
    turn, a pause, a resume), checking that nothing leaves while paused: what was sent,
    and what was written (BATCH frames unpacked), once resumed at a turn's end."""
    clock = Clock()
    writes = WriteCoalescer(clock)
    sent: list[bytes] = []
    written: list[bytes | memoryview] = []
    for n, event in enumerate(sequence):
        if event.startswith(("send", "small")):
            clock.advance(LATER if event == "send later" else SOON)
            sent.append(b"%d" % n)
            if event == "small soon" and writes.holds_next():
                out = writes.send_entry(entry(sent[-1]))
            else:
                out = writes.send([sent[-1]])
        elif event == "end turn":
            out = writes.end_turn()
        elif event == "pause":
            writes.pause()
            out = []
        else:
            out = writes.resume()
        assert not (writes.paused and out), sequence
        written += out
    written += writes.resume() + writes.end_turn()
    return sent, unbatched(written)


def test_any_sequence_with_entries_keeps_every_message_once_and_in_order() -> None:
    """As above, with small messages sent as entries whenever they would wait."""
    events = ("send soon", "send later", "small soon", "end turn", "pause", "resume")
    for sequence in itertools.product(events, repeat=5):
        sent, written = replay(sequence)
        assert written == sent, sequence


# -- the read gate ---------------------------------------------------------------------


def test_the_gate_reads_until_told_otherwise() -> None:
    gate = ReadGate()
    assert gate.reading
    assert not gate.resume() and not gate.catch_up()  # no change: nothing to tell


def test_the_owner_pauses_and_resumes() -> None:
    gate = ReadGate()
    assert gate.pause() and not gate.reading
    assert not gate.pause()  # told once
    assert gate.resume() and gate.reading


def test_catching_up_pauses_and_resumes() -> None:
    gate = ReadGate()
    assert gate.fall_behind() and not gate.reading
    assert not gate.fall_behind()
    assert gate.catch_up() and gate.reading


def test_reading_resumes_only_when_both_the_owner_and_the_backlog_allow() -> None:
    gate = ReadGate()
    assert gate.pause()
    assert not gate.fall_behind()  # already paused
    assert not gate.resume() and not gate.reading  # still catching up
    assert gate.catch_up() and gate.reading

    assert gate.fall_behind()
    assert not gate.pause()
    assert not gate.catch_up() and not gate.reading  # the owner still says stop
    assert gate.resume() and gate.reading


def test_the_transport_hears_every_change_and_only_changes() -> None:
    """Every sequence of inputs: following the answers keeps a transport in the state
    the two inputs call for."""
    moves = {
        "pause": ReadGate.pause,
        "resume": ReadGate.resume,
        "fall behind": ReadGate.fall_behind,
        "catch up": ReadGate.catch_up,
    }
    for sequence in itertools.product(moves, repeat=5):
        gate, transport_reads = ReadGate(), True
        for move in sequence:
            if moves[move](gate):
                transport_reads = not transport_reads
            assert transport_reads == (not gate.paused and not gate.catching_up), sequence
            assert transport_reads == gate.reading
