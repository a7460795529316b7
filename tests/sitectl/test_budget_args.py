"""``polca budget``'s arguments, checked before any connection: a window's end, the watts,
the reason; each refused with one line and exit 78."""

from __future__ import annotations

import pytest

from polca import cli
from polca.errors import ConfigError
from polca.sitectl.budget import until_ns

S = 1_000_000_000
NOW = 1_796_688_000 * S  # 2026-12-08T00:00:00Z


def test_a_window_ends_at_a_time_with_its_zone_or_a_span_from_now() -> None:
    assert until_ns("+90m", now_ns=NOW) == NOW + 90 * 60 * S
    assert until_ns("+2h", now_ns=NOW) == NOW + 7200 * S
    assert until_ns("+1.5d", now_ns=NOW) == NOW + 129_600 * S
    assert until_ns("2026-12-08T14:00Z", now_ns=NOW) == NOW + 14 * 3600 * S
    assert until_ns("2026-12-08T15:00:00+01:00", now_ns=NOW) == NOW + 14 * 3600 * S


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("2026-12-08T14:00", "no time zone"),
        ("tomorrow", "give a time with its zone"),
        ("2026-12-07T14:00Z", "between now and a year"),
        ("+400d", "between now and a year"),
        ("+0s", "between now and a year"),
        ("-5m", "give a time with its zone"),
    ],
)
def test_a_window_that_is_not_one_is_refused(text: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        until_ns(text, now_ns=NOW)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["set", "ups-a", "--watts", "lots", "--reason", "x"], "--watts must be a number"),
        (["set", "ups-a", "--watts", "nan", "--reason", "x"], "--watts must be a number"),
        (["set", "ups-a", "--watts", "-5", "--reason", "x"], "--watts must be a number"),
        (["set", "ups-a", "--watts", "5", "--reason", "  "], "--reason must say why"),
        (["set", "ups/a", "--watts", "5", "--reason", "x"], "the limit cannot be sent"),
        (["set", "ups-a", "--watts", "5", "--reason", "x", "--until", "soon"], "--until"),
        (["show", "--timeout", "0"], "--timeout must be"),
    ],
)
def test_bad_arguments_fail_in_one_line_before_connecting(
    args: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Port 9 (discard) on loopback: nothing answers, and nothing is tried.
    code = cli.main(["budget", *args, "--broker", "127.0.0.1:9"])
    err = capsys.readouterr().err
    assert code == 78
    assert err.count("\n") == 1
    assert says in err
