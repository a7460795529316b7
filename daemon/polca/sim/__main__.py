"""``python -m polca.sim simulate|plan ...``: the same as ``polca simulate|plan ...``."""

import sys

from polca.sim.cli import main, parse

if __name__ == "__main__":  # plan --jobs spawns workers that import this module again
    sys.exit(main(parse(sys.argv[1:])))
