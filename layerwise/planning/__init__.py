"""The planning room (mode=plan): inputs (config -> cost model inputs), roles, result (plan.json),
pipefisher, fits (the memory pre-flight rule), render, search, mode (the command). Below: config."""
