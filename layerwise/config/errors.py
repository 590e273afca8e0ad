"""The one error every bad input becomes: a list of problems, each naming the field and the fix."""


class ConfigError(ValueError):
    """One or more configuration problems; `problems` lists them, the message shows them all."""

    def __init__(self, problems):
        self.problems = list(problems)
        lines = "\n".join(f"  - {problem}" for problem in self.problems)
        super().__init__(f"invalid configuration ({len(self.problems)} problem"
                         f"{'s' if len(self.problems) > 1 else ''}):\n{lines}")
