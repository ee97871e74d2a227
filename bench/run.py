"""Run the benchmark on the local GPUs: ``python bench/run.py [options]`` (= ``hybrid-ep bench``).

See ``hybrid_ep_triton.tools.bench`` for what is measured; results land in bench/results/.
"""

import argparse
import sys

from hybrid_ep_triton.tools import bench

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    bench.add_arguments(parser)
    sys.exit(bench.run(parser.parse_args()))
