"""Run the benchmark on the local GPUs: ``python bench/run.py [options]`` (= ``hybrid-ep bench``).

See ``hybrid_ep_triton._bench`` for what is measured; results land in bench/results/.
"""

import argparse
import sys

from hybrid_ep_triton import _bench

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    _bench.add_arguments(parser)
    sys.exit(_bench.run(parser.parse_args()))
