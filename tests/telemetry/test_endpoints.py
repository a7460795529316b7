"""EndpointRotation, driven directly with plain times: the order the bus tries its broker
endpoints in, the hold-down, the longest-ago fallback, the one-shot attempts, the failover
count and when ``move_on`` may leave a node. No broker, no event loop
(``test_bus_failover.py`` checks the same against real Mosquittos)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from polca.telemetry.endpoints import HOLD_DOWN_S, EndpointRotation, Failure

ABC = ("a:1883", "b:1883", "c:1883")


def test_starts_at_the_first_endpoint() -> None:
    """The first endpoint configured is the first one tried; no failover yet."""
    rotation = EndpointRotation(ABC)
    assert (rotation.current, rotation.count, rotation.failovers) == (0, 3, 0)
    assert rotation.endpoints[rotation.current] == "a:1883"


def test_no_endpoints_is_refused() -> None:
    """A bus with nowhere to connect is a programming error, said at once."""
    with pytest.raises(ValueError, match="at least one"):
        EndpointRotation(())


def test_failures_rotate_in_order_and_wrap() -> None:
    """Failures far enough apart try a, b, c, then a again."""
    rotation = EndpointRotation(ABC)
    tried = []
    for n in range(6):
        tried.append(rotation.current)
        rotation.failed(rotation.current, n * HOLD_DOWN_S, connected=False)
    assert tried == [0, 1, 2, 0, 1, 2]


def test_a_recently_failed_endpoint_is_passed_over() -> None:
    """a failed lately: when b fails, c is next, not a (the Mosquitto test's a, b, c)."""
    rotation = EndpointRotation(ABC)
    rotation.connected(0)
    assert rotation.failed(0, 100.0, connected=True) == Failure(next_index=1, spent=False)
    rotation.connected(1)
    assert rotation.failed(1, 110.0, connected=True).next_index == 2
    assert rotation.held_down(0, 110.0)


def test_the_hold_down_ends_after_its_time() -> None:
    """At exactly ``hold_down_s`` after its failure an endpoint is eligible again."""
    rotation = EndpointRotation(ABC, hold_down_s=10.0)
    rotation.failed(0, 100.0, connected=False)
    assert rotation.held_down(0, 109.999)
    assert not rotation.held_down(0, 110.0)
    assert rotation.next_after(2, 110.0) == 0
    assert rotation.next_after(2, 109.0) == 1


def test_when_all_are_held_down_the_longest_ago_comes_next() -> None:
    """a and b failed lately, b more recently: when c fails, a (the oldest failure) is next."""
    rotation = EndpointRotation(ABC)
    rotation.failed(0, 100.0, connected=True)
    rotation.failed(1, 105.0, connected=True)
    assert rotation.failed(2, 110.0, connected=True).next_index == 0


def test_a_connection_clears_its_endpoints_failure() -> None:
    """Connecting to a held-down endpoint takes it off the hold-down."""
    rotation = EndpointRotation(ABC)
    rotation.failed(0, 100.0, connected=False)
    rotation.failed(1, 101.0, connected=False)
    rotation.failed(2, 102.0, connected=False)
    rotation.connected(0)
    assert not rotation.held_down(0, 103.0)
    assert rotation.failed(2, 103.0, connected=True).next_index == 0


def test_a_single_endpoint_is_always_the_one() -> None:
    """With one endpoint every failure comes back to it, held down or not."""
    rotation = EndpointRotation(("only:1883",))
    for now_s in (0.0, 1.0, 2.0):
        assert rotation.failed(0, now_s, connected=False).next_index == 0


def test_one_attempt_is_one_round_over_every_endpoint() -> None:
    """attempts=1: spent at the failure of the last endpoint, when the rotation wraps (the
    bus's one-shot commands log two failures and raise on the third)."""
    rotation = EndpointRotation(ABC, attempts=1)
    results = [rotation.failed(i, float(i), connected=False) for i in range(3)]
    assert [r.spent for r in results] == [False, False, True]
    assert results[-1].next_index == 0


def test_one_attempt_on_one_endpoint_is_spent_at_once() -> None:
    """attempts=1, one endpoint: the first failure spends it."""
    rotation = EndpointRotation(("only:1883",), attempts=1)
    assert rotation.failed(0, 0.0, connected=False).spent


@pytest.mark.parametrize(("attempts", "count"), [(2, 1), (2, 3), (3, 2), (5, 4)])
def test_n_attempts_are_n_rounds(attempts: int, count: int) -> None:
    """attempts=N: spent at the N-th round's last failure, not before."""
    rotation = EndpointRotation([f"mq{i}:1883" for i in range(count)], attempts=attempts)
    spent = [
        rotation.failed(rotation.current, float(n), connected=False).spent
        for n in range(attempts * count)
    ]
    assert spent == [False] * (attempts * count - 1) + [True]


def test_no_attempts_limit_is_never_spent() -> None:
    """attempts=None (the daemons): trying goes on forever."""
    rotation = EndpointRotation(ABC)
    assert not any(
        rotation.failed(rotation.current, float(n), connected=False).spent for n in range(30)
    )


def test_a_lost_connection_counts_no_attempt() -> None:
    """A connection lost after its CONNACK does not end a round, even when it wraps."""
    rotation = EndpointRotation(("a:1883", "b:1883"), attempts=1)
    assert not rotation.failed(0, 0.0, connected=False).spent
    rotation.connected(1)
    assert rotation.failed(1, 1.0, connected=True) == Failure(next_index=0, spent=False)
    assert not rotation.failed(0, 2.0, connected=False).spent
    assert rotation.failed(1, 3.0, connected=False).spent


def test_begin_counts_the_attempts_again() -> None:
    """A new connect loop starts the attempts afresh, where the last one left off."""
    rotation = EndpointRotation(("a:1883", "b:1883"), attempts=1)
    rotation.failed(0, 0.0, connected=False)
    assert rotation.failed(1, 1.0, connected=False).spent
    rotation.begin()
    assert rotation.current == 0
    assert not rotation.failed(0, 2.0, connected=False).spent
    assert rotation.failed(1, 3.0, connected=False).spent


def test_failovers_count_moves_to_another_endpoint() -> None:
    """The first connection is no failover; reconnecting to the same endpoint is none; each
    connection to another endpoint than the one before is one."""
    rotation = EndpointRotation(ABC)
    assert rotation.connected(0) is False
    assert rotation.connected(0) is False
    assert rotation.connected(1) is True
    assert rotation.connected(2) is True
    assert rotation.connected(0) is True
    assert rotation.failovers == 3


def test_failures_alone_are_no_failover() -> None:
    """Trying other endpoints without connecting to one moves nothing."""
    rotation = EndpointRotation(ABC)
    rotation.connected(0)
    for n in range(5):
        rotation.failed(rotation.current, float(n), connected=False)
    assert rotation.failovers == 0


def test_move_on_with_one_endpoint_does_nothing() -> None:
    """Nowhere to go: a move is never warranted, and the reason is not kept."""
    rotation = EndpointRotation(("only:1883",))
    assert rotation.move_on("silent", connected=True) is False
    assert rotation.move_reason == ""


def test_move_on_only_while_connected() -> None:
    """With several endpoints a move is warranted while connected, and keeps its reason."""
    rotation = EndpointRotation(ABC)
    assert rotation.move_on("early", connected=False) is False
    assert rotation.move_reason == ""
    assert rotation.move_on("silent", connected=True) is True
    assert rotation.move_reason == "silent"


@pytest.mark.parametrize("index", [-1, 3])
def test_an_index_out_of_range_is_refused(index: int) -> None:
    """Only the rotation's own indexes can fail or connect."""
    rotation = EndpointRotation(ABC)
    with pytest.raises(ValueError, match="no broker endpoint"):
        rotation.failed(index, 0.0, connected=False)
    with pytest.raises(ValueError, match="no broker endpoint"):
        rotation.connected(index)


# One step of a bus's life: a failure after ``gap_s`` more seconds (``connected``: after a
# CONNACK), or a connection to the endpoint being tried.
_steps = st.lists(
    st.one_of(
        st.tuples(
            st.just("failed"), st.floats(min_value=0.0, max_value=2 * HOLD_DOWN_S), st.booleans()
        ),
        st.tuples(st.just("connected"), st.just(0.0), st.just(False)),
    ),
    max_size=40,
)


@given(
    count=st.integers(min_value=1, max_value=5),
    hold_down_s=st.floats(min_value=0.0, max_value=HOLD_DOWN_S),
    steps=_steps,
)
def test_the_next_endpoint_is_valid_and_prefers_one_not_held_down(
    count: int, hold_down_s: float, steps: list[tuple[str, float, bool]]
) -> None:
    """For any failures and times: the endpoint to try is one of the endpoints; it is the
    first after the failed one not held down, and a held-down one only when all are, then
    the one that failed longest ago. Checked against a model of when each last failed."""
    rotation = EndpointRotation([f"mq{i}:1883" for i in range(count)], hold_down_s=hold_down_s)
    failed_at: dict[int, float] = {}  # the model
    now_s = 1000.0
    for kind, gap_s, connected in steps:
        index = rotation.current
        assert 0 <= index < count
        if kind == "connected":
            rotation.connected(index)
            failed_at.pop(index, None)
            continue
        now_s += gap_s
        failed_at[index] = now_s
        chosen = rotation.failed(index, now_s, connected=connected).next_index
        assert chosen == rotation.current
        assert 0 <= chosen < count
        order = [(index + step) % count for step in range(1, count + 1)]
        free = [i for i in order if now_s - failed_at.get(i, -1e12) >= hold_down_s]
        if free:
            assert chosen == free[0]
        else:
            assert failed_at[chosen] == min(failed_at.values())
