"""The simulator's GPU profiles against published measurements, and re-fitted to them.

For each shipped profile named here, ``polca.sim.published.fit`` fits the clock and decode
constants to the points of ``polca/data/published/points.yaml`` that name its GPU, under a
prior around the shipped values. Run from the repository root:

    .venv/bin/python bench/published_fit.py [--plot docs/img/published-fit.png]
        [--write-profiles daemon/polca/data/published]

It prints every point's band against the shipped and the re-fitted prediction, writes
``bench/results/published_fit.json``, and with ``--write-profiles`` the re-fitted profiles
(``<profile>-published.yaml``, selectable with ``polca simulate|plan --profile FILE``).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.benchkit import write_result  # noqa: E402

from polca.sim import published  # noqa: E402
from polca.sim.model import profile_gpu_and_server  # noqa: E402
from polca.sim.profile import parse_profile, shipped_profile  # noqa: E402

PROFILES = ("a100-sxm4", "h100-sxm")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", action="append", default=None, help="shipped profile")
    parser.add_argument("--points", type=Path, default=None, help="another points file")
    parser.add_argument("--plot", type=Path, default=None, help="draw the curves here (PNG)")
    parser.add_argument("--write-profiles", type=Path, default=None, help="folder")
    parser.add_argument(
        "--out", type=Path, default=REPO / "bench" / "results" / "published_fit.json"
    )
    args = parser.parse_args()
    points = published.load_points(args.points)
    results = []
    fits = []
    for name in args.profile or PROFILES:
        profile = shipped_profile(name)
        base, _ = profile_gpu_and_server(profile)
        result = published.fit(base, points)
        results.append(dataclasses.asdict(result))
        print(f"{base.name}: cost {result.cost_before} -> {result.cost_after}")
        for key, before in result.before.items():
            after = result.after[key]
            mark = "" if after == before else "   <- re-fitted"
            print(f"  {key:<24} {before:>8g} -> {after:<8g}{mark}")
        for row in result.rows:
            band = "-".join(f"{v:g}" for v in row["band"])  # type: ignore[attr-defined]
            print(
                f"  {row['id']:<26} band {band:<12} shipped {row['shipped']} "
                f"(miss {row['miss_shipped']})  re-fitted {row['fitted']} "
                f"(miss {row['miss_fitted']})"
            )
        fitted_text = published.fitted_profile(profile, result, name=f"{profile.name}-published")
        fitted, _ = profile_gpu_and_server(parse_profile(fitted_text, source="re-fitted"))
        fits.append((base, fitted, points.for_gpu(base.name)))
        if args.write_profiles is not None:
            path = args.write_profiles / f"{name}-published.yaml"
            path.write_text(
                "# Written by bench/published_fit.py: the shipped profile with its clock and\n"
                "# decode constants re-fitted to polca/data/published/points.yaml.\n" + fitted_text,
                encoding="utf-8",
            )
            print(f"  wrote {path}")
    write_result(args.out, {"fits": results})
    if args.plot is not None:
        from polca.sim.plots import published_plot

        published_plot(args.plot, fits)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
