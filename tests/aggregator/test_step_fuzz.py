"""The aggregator's whole step under valid messages with extreme values (``tests/step_fuzz.py``).

Every message passes the decoder, with each field near its wire bound and GPU lists as long
as a payload carries; none may make a handler or a control step raise, or trip a
last-resort guard (``internal``, ``control_step_failed``). The CI budget is two seeds of
1,500 messages; ``bench/fuzz_step.py`` runs 100,000 and more.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import structlog

from tests.step_fuzz import run

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("seed", [0, 1])
def test_no_valid_message_makes_the_step_raise(tmp_path: Path, seed: int) -> None:
    """1,500 extreme but valid messages, a control step every 10: no exception anywhere."""
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))  # errors only
    found = run(tmp_path, ROOT / "policies" / "polca-h100.yaml", seed=seed, messages=1_500)
    assert found.escaped == []
    assert found.internal == 0
    assert found.step_failures == 0
    # The fuzz went deep: most messages were applied, steps decided, lies were found.
    assert found.accepted >= 0.9 * found.messages
    assert sum(found.levels.values()) == found.steps
    assert found.implausible["power"] > 0
    assert found.implausible["gpu_list"] > 0
