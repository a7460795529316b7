"""The long in-bounds fuzz of the aggregator's whole step: messages, steps, exceptions.

Runs the engine of ``tests/step_fuzz.py`` (valid messages with every field near its wire
bound, GPU lists as long as a payload carries, a control step every 10 messages) against
a real aggregator built in-process, for ``--messages`` messages per seed:

    .venv/bin/python bench/fuzz_step.py --messages 100000 --seed 0 --seed 1

It prints one line per seed and writes ``bench/results/fuzz_step.json`` (``messages``,
``steps``, ``exceptions``: escaping a handler or a step, or caught by a last-resort
guard; ``accepted``, ``implausible`` by reason, ``levels`` reached). The target is 0
exceptions; ``--strict`` exits 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import structlog  # noqa: E402
from tests.step_fuzz import run  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "fuzz_step.json"
POLICY = ROOT / "policies" / "polca-h100.yaml"


def main() -> int:
    """Run the campaign; returns the exit code."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--messages", type=int, default=100_000, help="per seed")
    parser.add_argument("--seed", type=int, action="append", help="repeatable (default 0)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--strict", action="store_true")
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(50))
    seeds = args.seed or [0]
    runs = []
    for seed in seeds:
        with tempfile.TemporaryDirectory() as tmp:
            found = run(Path(tmp), POLICY, seed=seed, messages=args.messages)
        runs.append(
            {
                "seed": seed,
                "messages": found.messages,
                "steps": found.steps,
                "exceptions": found.exceptions,
                "internal": found.internal,
                "step_failures": found.step_failures,
                "escaped": found.escaped[:20],
                "accepted": found.accepted,
                "dropped": dict(found.dropped),
                "implausible": dict(found.implausible),
                "levels": {str(k): v for k, v in sorted(found.levels.items())},
                "messages_per_s": round(found.messages / found.seconds),
            }
        )
        print(
            f"seed {seed}: {found.messages} messages, {found.steps} steps, "
            f"{found.exceptions} exceptions, {found.accepted} accepted, implausible "
            f"{dict(found.implausible)}, levels {dict(sorted(found.levels.items()))}, "
            f"{found.seconds:.0f} s"
        )
    result = {
        "messages": sum(r["messages"] for r in runs),
        "exceptions": sum(r["exceptions"] for r in runs),
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"total: {result['messages']} messages, {result['exceptions']} exceptions")
    return 1 if args.strict and result["exceptions"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
