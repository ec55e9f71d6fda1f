"""``peers.py`` with the library's log on stderr (logger "dualkv_compile" at DEBUG): which route compiled the packed
graph, how many times, and any fallback, beside the step times. Usage: as ``peers.py``."""

import logging
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # the repository
from benchmarks.peers import peers  # noqa: E402

if __name__ == "__main__":
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[%(name)s %(levelname)s] %(message)s"))
    logger = logging.getLogger("dualkv_compile")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    sys.exit(peers.main(sys.argv[1:]))
