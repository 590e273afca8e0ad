"""Every command the documentation tells a user to type runs here and does what the text says.

Why: nothing ran the documented commands, so a change that broke the README's first paper-claim
command landed unnoticed (issue 28). This file collects every command a user may copy:

- each line of a fenced block in README.md and docs/**/*.md that starts `python train.py`,
  `python -m layerwise...` or `make run` (a `$ ` prompt dropped, `\\` continuations joined, the
  trailing `# comment` kept apart: it is where a command that cannot run here says so);
- `python train.py experiment=<name>` for every conf/experiment/*.yaml;

and runs each one the way HOW (tests/documented_commands.py) says, keyed by the command's text, so documents and this table cannot
drift apart: a command without an entry, or an entry whose command is no longer documented, fails.

- `real`: as typed.
- `capped`: as typed plus a step cap (TRAINING_CAP: 2 steps), for a command that trains for minutes.
- `check`: plus `mode=check`: a paper-scale, GPU, cluster or more-ranks-than-cores command, or one
  that trains for minutes with no step knob; `why` names what runs it for real.
- `plan`: plus `mode=plan`: a GPU command, planned on its own profile.

Each must exit 0, or the exit code its document shows (a `$ ` command followed by its output: the
output is asserted too), and leave its evidence: a training run `summary.json` with status
`completed`, plan mode `plan.json`, a reproduction its `results.json`, mode=check its "valid" line
and no run. A command that cannot run here carries its reason next to it in the document (`mark`:
"(needs a GPU)", "(needs Slurm)"); that the mark is there is tested, nothing is skipped silently.

Every command runs in its own temporary directory (runs/ lands there, not in the repository), as a
process of its own forked from one warm interpreter (tests/warm_python.py: no 6 s of imports each), at most
two at once (this machine has 2 cores); a command that reads another's output (`after`) runs in that
one's directory once it has finished.
"""

import os
import re
import shlex
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import List

import pytest

from tests.documented_commands import BARE_TRAIN_PY, DOCUMENTED, HOW, ROOT, How, Outcome, one
from tests.warm_python import python

WORKERS = max(1, min(2, os.cpu_count() or 1))
TIMEOUT_S = 900


# ================================================================ running them

def argv_of(command: str, how: How, cwd: Path) -> List[str]:
    """The command as this machine runs it: this interpreter, train.py by its path, the run kind's
    arguments appended, a `<placeholder>` path replaced by the one path it names in `cwd`."""
    words = shlex.split(command)
    if words[:2] == ["make", "run"]:  # the Makefile's run target is `$(BIN)/python train.py $(ARGS)`
        words = ["python", "train.py", *words[2:]]
    words[0] = sys.executable
    if words[1] == "train.py":
        words[1] = str(ROOT / "train.py")
    words = [str(one(re.sub(r"<[^>]+>", "*", w), cwd).relative_to(cwd)) if "<" in w else w for w in words]
    added = {"real": (), "capped": how.cap, "check": ("mode=check",), "plan": ("mode=plan",)}[how.run]
    return words + list(added) + [argument.format(cwd=cwd) for argument in how.extra]


class Runner:
    """Runs the commands at most WORKERS at once, each once per session, prerequisites first."""

    def __init__(self, root: Path):
        self.root, self.futures = root, {}
        self.pool = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="documented")

    def start(self, command: str):
        if command not in self.futures:
            how = HOW[command]
            prerequisite = self.start(how.after) if how.after else None
            cwd = self.root / f"{len(self.futures):02d}"
            self.futures[command] = self.pool.submit(self._run, command, how, cwd, prerequisite)
        return self.futures[command]

    def _run(self, command: str, how: How, cwd: Path, prerequisite) -> Outcome:
        if prerequisite is not None:  # submitted earlier: already running or done
            before = prerequisite.result()
            assert before.code == 0, f"prerequisite `{before.command}` failed"
            # a copy: the prerequisite's own test may be reading its directory meanwhile
            shutil.copytree(before.cwd, cwd, symlinks=True)
        else:
            cwd.mkdir()
        if how.prepare is not None:
            how.prepare(cwd)
        argv = argv_of(command, how, cwd)
        started = time.time()
        started_s = time.monotonic()
        result = python(argv, cwd, {**os.environ, "WANDB_MODE": "disabled"}, TIMEOUT_S)
        code, stdout, stderr, seconds = result.returncode, result.stdout, result.stderr, time.monotonic() - started_s
        return Outcome(command, argv, cwd, code, stdout, stderr, seconds, started)

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        done = [f.result() for f in self.futures.values() if f.done() and not f.cancelled() and not f.exception()]
        print(f"\n[documented commands] {len(done)} run, {sum(o.seconds for o in done):.0f} s of wall time "
              f"in all ({WORKERS} at once):")
        for outcome in sorted(done, key=lambda o: -o.seconds):
            print(f"  {outcome.seconds:6.1f} s  exit {outcome.code}  {HOW[outcome.command].run:6}  {outcome.command}")


@pytest.fixture(scope="module")
def runner(request, tmp_path_factory):
    """Starts every selected command at once (in document order), so two run side by side."""
    runner = Runner(tmp_path_factory.mktemp("documented"))
    for item in request.session.items:
        command = getattr(getattr(item, "callspec", None), "params", {}).get("command")
        if item.module is request.module and command in HOW:
            runner.start(command)
    yield runner
    runner.close()


# ================================================================ the tests

def short(command: str) -> str:
    words = command.replace("python train.py", "train.py").replace("python -m ", "")
    return words if len(words) <= 70 else words[:67] + "..."


@pytest.mark.parametrize("command", list(DOCUMENTED), ids=[short(c) for c in DOCUMENTED])
def test_documented_command_runs(command, runner):
    assert command in HOW, f"not in HOW: {command}"  # test_every_documented_command_is_classified says more
    outcome = runner.start(command).result()
    HOW[command].expect(outcome)


def test_every_documented_command_is_classified():
    """A new command in a document, or a changed one, needs its entry: the docs and HOW move together."""
    unknown = {text: entry.where for text, entry in DOCUMENTED.items() if text not in HOW}
    assert not unknown, ("documented commands with no entry in HOW (say how each runs here: real, capped, "
                         "check or plan, and what it must leave):\n"
                         + "\n".join(f"  {where}: {text}" for text, where in unknown.items()))


def test_every_entry_is_still_documented():
    stale = [text for text in HOW if text not in DOCUMENTED]
    assert not stale, "entries in HOW for commands no document shows any more:\n" + "\n".join(stale)


def test_commands_that_cannot_run_here_say_so_where_they_are_documented():
    for text, how in HOW.items():
        if how.mark and text in DOCUMENTED:
            for where, comment in zip(DOCUMENTED[text].where, DOCUMENTED[text].comments):
                assert how.mark in comment, f"{where}: `{text}` needs the mark {how.mark!r} in its comment"


def test_entries_that_do_not_run_as_typed_say_why():
    for text, how in HOW.items():
        assert how.run in ("real", "capped", "check", "plan"), text
        assert how.run == "real" or how.why or how.mark, f"`{text}` runs as {how.run}: say why in HOW"
        assert not how.after or how.after in HOW, f"`{text}` runs after an unknown command"


def test_documents_show_commands_a_user_can_type():
    """Every command is complete as written: an interpreter before train.py, no `...` in place of
    arguments."""
    for text, entry in DOCUMENTED.items():
        assert not BARE_TRAIN_PY.match(text), f"{entry.where}: write `python {text}`"
        assert "..." not in text, f"{entry.where}: `{text}` is not a complete command"


def test_make_run_is_train_py():
    """`make run` runs above as `python train.py`: what the Makefile's run target does."""
    recipe = (ROOT / "Makefile").read_text().split("\nrun:")[1].split("\n\n")[0]
    assert "$(BIN)/python train.py $(ARGS)" in recipe, recipe
