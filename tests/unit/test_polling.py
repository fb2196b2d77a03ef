"""Busy-polling: how long the loop spins after activity, and how that adapts to the traffic.

The poller runs on a real event loop but reads a fake clock, so every gap is exact.
"""

from __future__ import annotations

import asyncio

import pytest

from asyncrpc.agent.polling import GROWTH, MAX_FACTOR, BusyPoller, oversubscribed

pytestmark = pytest.mark.timeout(10)
WINDOW = 300e-6


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def run_out(poller: BusyPoller, clock: Clock) -> None:
    """Let the current window pass with nothing happening: polling stops."""
    clock.now = poller._until
    while poller._active:
        await asyncio.sleep(0)


async def make(window: float = WINDOW) -> tuple[BusyPoller, Clock]:
    clock = Clock()
    return BusyPoller(window, lambda: True, clock), clock


async def test_activity_keeps_the_loop_turning_until_the_window_runs_out() -> None:
    poller, clock = await make()
    poller.kick()
    for _ in range(5):
        await asyncio.sleep(0)
        assert poller._active  # time does not pass on the fake clock
    await run_out(poller, clock)
    assert not poller._active


async def test_a_gap_just_past_the_window_grows_it_to_cover_that_gap() -> None:
    poller, clock = await make()
    poller.kick()
    last_activity = clock.now
    await run_out(poller, clock)
    clock.now = last_activity + 2 * WINDOW  # came soon after polling gave up
    poller.kick()
    assert poller.current == pytest.approx(2 * WINDOW * GROWTH)
    assert poller._until - clock.now >= 2 * WINDOW  # the same gap is caught next time


async def test_the_window_grows_at_most_to_its_limit_and_a_long_gap_halves_it() -> None:
    poller, clock = await make()
    longest = WINDOW * MAX_FACTOR
    for gap in (longest * 0.9, longest * 0.99):
        poller.kick()
        start = clock.now
        await run_out(poller, clock)
        clock.now = start + gap
        poller.kick()
        assert WINDOW < poller.current <= longest
    await run_out(poller, clock)
    grown = poller.current
    clock.now += 10 * longest  # idle for long: the spinning was wasted
    poller.kick()
    assert poller.current == pytest.approx(grown / 2)


async def test_long_idle_spells_shrink_it_back_to_the_configured_window() -> None:
    poller, clock = await make()
    poller.current = WINDOW * MAX_FACTOR
    for _ in range(10):
        poller.kick()
        await run_out(poller, clock)
        clock.now += 1.0
    assert poller.current == WINDOW


async def test_stopping_because_polling_is_unwanted_teaches_nothing() -> None:
    clock, wanted = Clock(), [True]
    poller = BusyPoller(WINDOW, lambda: wanted[0], clock)
    poller.kick()
    wanted[0] = False  # slow pool jobs started
    while poller._active:
        await asyncio.sleep(0)
    clock.now += 2 * WINDOW
    wanted[0] = True
    poller.kick()
    assert poller.current == WINDOW


async def test_a_zero_window_never_polls_and_setting_the_window_resets_it() -> None:
    poller, _ = await make(0.0)
    poller.kick()
    assert not poller._active
    poller.window = WINDOW
    poller.current = 5 * WINDOW
    poller.window = 2 * WINDOW
    assert poller.current == 2 * WINDOW


async def test_work_a_frame_scheduled_runs_before_the_next_turn_and_its_yield() -> None:
    """A frame handed up schedules work (a reply's waiter, a call's task): the poller's
    next turn, already queued, goes behind it, once a turn however many frames come."""
    order: list[str] = []
    poller, clock = await make()
    turn = poller._turn

    def recording_turn() -> None:
        order.append("turn")
        turn()

    poller._turn = recording_turn  # type: ignore[method-assign]
    poller.kick()  # polling: a turn is queued
    await asyncio.sleep(0)
    order.clear()
    loop = asyncio.get_running_loop()
    loop.call_soon(order.append, "first frame's work")
    poller.kick(behind=True)
    loop.call_soon(order.append, "second frame's work")
    poller.kick(behind=True)  # the turn moves once: it is already behind the first
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert order[:3] == ["first frame's work", "turn", "second frame's work"]
    await run_out(poller, clock)
    assert order.count("turn") >= 2 and not poller._active


@pytest.mark.parametrize(
    ("workers", "threads", "cpus", "each"),
    [(2, 2, 2, 1), (3, 4, 8, 2), (4, 8, 2, 1), (2, 16, 16, 8)],
)
def test_workers_whose_torch_threads_crowd_the_cpus_are_told_what_to_set(
    workers: int, threads: int, cpus: int, each: int
) -> None:
    why = oversubscribed(workers, threads, cpus)
    assert why is not None
    assert f"{workers} workers share this host's {cpus} CPUs" in why
    assert f"torch.set_num_threads({each})" in why and f"OMP_NUM_THREADS={each}" in why


@pytest.mark.parametrize(
    ("workers", "threads", "cpus"),
    [(1, 2, 2), (2, 1, 2), (3, 1, 2), (2, 2, 4), (4, 4, 16)],
)
def test_workers_with_a_cpu_for_every_thread_or_one_thread_each_are_not_told(
    workers: int, threads: int, cpus: int
) -> None:
    assert oversubscribed(workers, threads, cpus) is None
