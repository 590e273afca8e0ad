"""`python -m layerwise.export RUN_DIR --out model.safetensors`: the command of layerwise/tools/export.py."""

from layerwise.tools.export import main

if __name__ == "__main__":
    main()
