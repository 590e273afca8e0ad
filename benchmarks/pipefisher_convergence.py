"""K-FAC vs the first-order optimizer: steps to a target validation loss, each method tuned fairly.

    .venv/bin/python benchmarks/pipefisher_convergence.py [--model bert_tiny --steps 150 --every 10]

The command line of layerwise/reproduce/convergence.py (the comparison the PipeFisher claim runs);
its docstring says what is compared and how.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from layerwise.reproduce.convergence import main  # noqa: E402

if __name__ == "__main__":
    main()
