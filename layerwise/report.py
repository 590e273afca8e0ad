"""`python -m layerwise.report SWEEP_DIR [...]`: the command of layerwise/tools/report.py."""

import sys

from layerwise.tools.report import main

if __name__ == "__main__":
    sys.exit(main())
