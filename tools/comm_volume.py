"""Print the bytes each rank sends per step in P2P and gradient reduction, next to
the minimum it must send, for a recipe and a layout.

    python tools/comm_volume.py --recipe recipes/tiny-llama.yaml --layout tests/layouts/tp4-tp2-tp1.yaml

It launches a torchrun world of the layout's size that trains one real step and
counts the traffic (see ``elastor_mcore/elastic/rank/traffic.py``).
"""

import argparse
import sys

from elastor_mcore.config.recipe import load_recipe
from elastor_mcore.config.run import RunSettings
from elastor_mcore.elastic.torchrun import run_torchrun
from elastor_mcore.parallel.layout import load_layout


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--layout", required=True)
    args = parser.parse_args()
    layout = load_layout(args.layout, load_recipe(args.recipe))
    print(f"training one step on {layout.world_size} ranks to count traffic...", flush=True)
    settings = RunSettings(recipe=args.recipe, layout=args.layout, steps=1)
    return run_torchrun(layout.world_size, "elastor_mcore.elastic.rank.traffic",
                        settings.to_argv("worker")).returncode


if __name__ == "__main__":
    sys.exit(main())
