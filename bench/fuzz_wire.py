"""The long fuzz run of the MQTT wire: payloads tried, crashes, wrongly accepted.

Runs the mutation engine of ``tests/wire_fuzz.py`` (structured mutations of a valid
message of every kind, each knowing whether it must be refused) over ``--payloads``
payloads, plus random byte strings, through:

- ``polca.telemetry.schema.decode``: a *crash* is any exception but ``SchemaError``; a
  payload that must be refused but decodes is *wrongly accepted*;
- the message handlers of a real agent and a real aggregator built in-process, on every
  topic each subscribes to, live and retained: a crash is an exception escaping a handler
  or one counted ``internal`` by its last-resort guard.

    .venv/bin/python bench/fuzz_wire.py --payloads 100000 --seed 1

It prints a table and writes ``bench/results/fuzz.json`` (``payloads``, ``crashes``,
``wrongly_accepted``, per operation, and the handler figures). The target is 0 crashes and
0 wrongly accepted; ``--strict`` exits 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import structlog  # noqa: E402
from tests.telemetry.test_wire_fuzz import (  # noqa: E402
    _agent,
    _agent_topics,
    _aggregator,
    _aggregator_topics,
)
from tests.wire_fuzz import KINDS, check, mutate, valid_messages  # noqa: E402

from polca.errors import SchemaError  # noqa: E402
from polca.telemetry.messages import InMessage  # noqa: E402
from polca.telemetry.schema import decode  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "fuzz.json"


def _fuzz_decoder(rng: random.Random, payloads: int) -> dict[str, object]:
    """Mutants (and one in ten random byte strings) through ``decode``."""
    valid = valid_messages()
    tried: Counter[str] = Counter()
    crashes: Counter[str] = Counter()
    wrong: Counter[str] = Counter()
    must_reject = 0
    examples: list[str] = []
    started = time.perf_counter()
    for i in range(payloads):
        if i % 10 == 9:
            tried["random_bytes"] += 1
            try:
                decode(rng.randbytes(rng.randrange(1, 512)))
            except SchemaError:
                pass
            except Exception as exc:
                crashes["random_bytes"] += 1
                examples.append(f"crash {type(exc).__name__} on random bytes")
            continue
        kind = rng.choice(KINDS)
        mutant = mutate(rng, kind, valid[kind])
        tried[mutant.operation] += 1
        must_reject += mutant.must_reject
        _, finding = check(mutant, decode, SchemaError)
        if finding is not None:
            (crashes if finding.startswith("crash") else wrong)[mutant.operation] += 1
            if len(examples) < 20:
                examples.append(finding)
    elapsed_s = time.perf_counter() - started
    return {
        "payloads": payloads,
        "must_reject": must_reject,
        "crashes": sum(crashes.values()),
        "wrongly_accepted": sum(wrong.values()),
        "decode_payloads_per_s": round(payloads / elapsed_s),
        "by_operation": {
            op: {"tried": n, "crashes": crashes[op], "wrongly_accepted": wrong[op]}
            for op, n in sorted(tried.items())
        },
        "examples": examples,
    }


def _fuzz_handlers(rng: random.Random, payloads: int) -> tuple[int, int]:
    """Mutants through a real agent's and aggregator's handlers: (messages, crashes)."""
    valid = valid_messages()
    handled = crashes = 0
    with tempfile.TemporaryDirectory() as tmp:
        agent = _agent(Path(tmp))
        aggregator = _aggregator(Path(tmp))
        now = time.time_ns()
        for i in range(payloads):
            kind = rng.choice(KINDS)
            payload = mutate(rng, kind, valid[kind]).payload
            for topic in _agent_topics():
                handled += 1
                try:
                    agent.handle_message(InMessage(topic, payload, i % 2 == 0, now, 1))
                except Exception:
                    crashes += 1
            for topic in _aggregator_topics():
                handled += 1
                try:
                    aggregator.handle_message(InMessage(topic, payload, i % 2 == 0, now, 1))
                except Exception:
                    crashes += 1
        crashes += agent.core.drops.counts["internal"] + aggregator.intake.dropped["internal"]
    return handled, crashes


def main() -> int:
    """Run the fuzz campaign; returns the exit code."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--payloads", type=int, default=100_000)
    parser.add_argument("--handler-payloads", type=int, default=20_000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--strict", action="store_true")
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(50))
    rng = random.Random(args.seed)
    result = _fuzz_decoder(rng, args.payloads)
    handled, handler_crashes = _fuzz_handlers(rng, args.handler_payloads)
    result.update(seed=args.seed, handler_messages=handled, handler_crashes=handler_crashes)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"{'operation':<16}{'tried':>10}{'crashes':>10}{'wrongly accepted':>18}")
    by_operation = result["by_operation"]
    assert isinstance(by_operation, dict)
    for op, row in by_operation.items():
        print(f"{op:<16}{row['tried']:>10}{row['crashes']:>10}{row['wrongly_accepted']:>18}")
    print(
        f"decoder: {args.payloads} payloads ({result['must_reject']} that must be refused), "
        f"{result['crashes']} crashes, {result['wrongly_accepted']} wrongly accepted, "
        f"{result['decode_payloads_per_s']} payloads/s"
    )
    print(f"handlers: {handled} messages, {handler_crashes} crashes or internal errors")
    for line in result["examples"]:  # type: ignore[attr-defined]
        print("  ", line)
    failed = result["crashes"] or result["wrongly_accepted"] or handler_crashes
    return 1 if args.strict and failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
