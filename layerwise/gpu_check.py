"""`python -m layerwise.gpu_check`: the command of layerwise/tools/gpu_check.py, with the pre-flight
checks (layerwise/preflight.py, above every room) deciding which points run."""

import sys

from layerwise.preflight import validate
from layerwise.tools.gpu_check import main

if __name__ == "__main__":
    sys.exit(main(preflight=validate))
