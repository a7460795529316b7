"""Seeded, counter-based randomness: SplitMix64, so that every simulation repeats exactly.

The simulated GPUs, their load profiles, the trace replay and the simulated cooling plant
all need random-looking numbers that depend only on a seed and a counter (a GPU index, a
time slot, a request), never on call order or on a shared generator's state: then the same
seed gives the same run whatever is queried first, and two GPUs never share a stream.
``mix64`` is that hash; it lives here, below every package that uses it, so none of them
imports another's module for it. Pure integer arithmetic: no state, no I/O, no imports.
"""

from __future__ import annotations

MASK64 = (1 << 64) - 1  # the hash works on unsigned 64-bit integers


def mix64(value: int) -> int:
    """SplitMix64 finaliser: a cheap, well-spread hash of a 64-bit integer."""
    value = (value + 0x9E3779B97F4A7C15) & MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & MASK64
    return value ^ (value >> 31)


__all__ = ["MASK64", "mix64"]
