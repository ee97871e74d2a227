"""Run the benchmark on the local GPUs: ``python bench/run.py [options]`` (= ``hybrid-ep bench``).

See ``hybrid_ep_triton.tools.bench`` for what is measured; results land in bench/results/.
"""

import sys

from hybrid_ep_triton.tools.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
