"""The shell blocks of README.md and docs/*.md run as written.

A block runs when the line right above its opening fence is the marker ``<!-- runnable -->``, or
``<!-- runnable; skip: PREFIX, PREFIX -->`` to leave out the commands starting with a PREFIX (an install step, or
one that needs a live deployment); every PREFIX must match a command, so a skip cannot outlive its command. A marked
block runs in bash, command after command, from the root of a copy of the repository with ``../shared`` beside it,
as CI's clone has, and with this environment's ``medflare`` on PATH; it must exit 0. ``MEDFLARE_SMOKE=1`` caps each
run the block builds (``medflare.console.run_options.SMOKE_CAPS``), so the commands stay exactly as written but run in seconds;
each capped run says so in its output.

Every other ``medflare`` command of a bash block must at least parse: the command line accepts its options, so an
unmarked command cannot rot silently when an option is renamed.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\s*$")
SHELL_LANGUAGES = {"bash", "sh", "shell"}
MARKER = re.compile(r"^<!--\s*runnable\s*(?:;\s*skip:\s*(?P<skip>.*?))?\s*-->$")
# what a shell block's command is joined and split by
SEPARATORS = {"&&", "||", ";", "|", "&"}
REDIRECTIONS = {">", ">>", "<", ">&", "&>"}
# a block that starts FLARE (simulator or POC) runs for tens of seconds even at smoke size
STARTS_FLARE = re.compile(r"\bmedflare (run|compare)\b|\bnvflare simulator\b|\bpoc/")


@dataclass(frozen=True)
class ShellBlock:
    """One fenced shell block of a Markdown file.

    Attributes:
        where: ``file:line`` of the opening fence.
        commands: the block's commands, one per line, backslash continuations joined.
        runnable: the line above the fence is the runnable marker.
        skip: the command prefixes the marker leaves out.
    """

    where: str
    commands: tuple[str, ...]
    runnable: bool
    skip: tuple[str, ...]

    def script(self) -> str:
        """The block as a bash script without its skipped commands: stop at the first failure, trace each command."""
        kept = [command for command in self.commands if not self.skipped(command)]
        return "\n".join(["set -eo pipefail -x", *kept]) + "\n"

    def skipped(self, command: str) -> bool:
        return any(command.startswith(prefix) for prefix in self.skip)


def shell_blocks(path: Path) -> list[ShellBlock]:
    """Every fenced bash/sh/shell block of ``path``, in order."""
    lines = path.read_text().splitlines()
    blocks: list[ShellBlock] = []
    index = 0
    while index < len(lines):
        opening = FENCE.match(lines[index].strip())
        if not opening or not opening.group(1):
            index += 1
            continue
        end = next(i for i in range(index + 1, len(lines)) if lines[i].strip().startswith("```"))
        if opening.group(1) in SHELL_LANGUAGES:
            marker = MARKER.match(lines[index - 1].strip()) if index else None
            skip = tuple(p.strip() for p in (marker.group("skip") or "").split(",") if p.strip()) if marker else ()
            blocks.append(ShellBlock(f"{path.relative_to(REPO)}:{index + 1}", tuple(joined(lines[index + 1:end])),
                                     marker is not None, skip))
        index = end + 1
    return blocks


def joined(lines: list[str]) -> list[str]:
    """Shell lines with their backslash continuations joined; blank and comment-only lines dropped."""
    commands: list[str] = []
    pending = ""
    for line in lines:
        pending += line.strip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        if pending and not pending.startswith("#"):
            commands.append(pending)
        pending = ""
    return commands


def medflare_argv(command: str) -> list[list[str]]:
    """The arguments of each ``medflare`` call in a shell command line (``a && b | c > f``; ``sudo`` and a path
    to the program allowed), without redirections and comments."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    calls: list[list[str]] = []
    current: list[str] = []
    tokens = iter(lexer)
    for token in tokens:
        if token in SEPARATORS:
            calls.append(current)
            current = []
        elif token in REDIRECTIONS:
            next(tokens, None)  # the redirection's target
        else:
            current.append(token)
    calls.append(current)
    programs = [call[1:] if call[:1] == ["sudo"] else call for call in calls]
    return [call[1:] for call in programs if call and Path(call[0]).name == "medflare"]


ALL_BLOCKS = [block for path in DOCS for block in shell_blocks(path)]
RUNNABLE = [block for block in ALL_BLOCKS if block.runnable]
MEDFLARE_CALLS = [(f"{block.where} {' '.join(argv[:2])}", argv) for block in ALL_BLOCKS
                  for command in block.commands for argv in medflare_argv(command)]


def test_the_docs_have_runnable_blocks_and_medflare_commands() -> None:
    assert any(block.where.startswith("README.md") for block in RUNNABLE), "the README's first steps lost the marker"
    assert len(MEDFLARE_CALLS) > 20, f"only {len(MEDFLARE_CALLS)} medflare commands found: is the parser broken?"


@pytest.mark.parametrize("where, argv", MEDFLARE_CALLS, ids=[where for where, _ in MEDFLARE_CALLS])
def test_every_documented_medflare_command_parses(where: str, argv: list[str],
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    from medflare.console.cli import make_parser

    try:
        make_parser().parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"{where}: 'medflare {shlex.join(argv)}' does not parse (exit {exc.code}): "
                    f"{capsys.readouterr().err.strip()}")


@pytest.mark.parametrize("block", RUNNABLE, ids=[block.where for block in RUNNABLE])
def test_skip_prefixes_match_a_command(block: ShellBlock) -> None:
    unmatched = [prefix for prefix in block.skip if not any(c.startswith(prefix) for c in block.commands)]
    assert not unmatched, f"{block.where}: the marker skips {unmatched}, which no command of the block starts with"


def repository_copy(root: Path) -> Path:
    """A copy of the repository as a fresh clone has it (tracked and untracked files, nothing git ignores) in
    ``root/medflare``, with ``root/shared`` pointing at ../shared and ``.venv`` at this environment."""
    copy = root / "medflare"
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=False)
    if listed.returncode == 0:
        for name in filter(None, listed.stdout.decode().split("\0")):
            source = REPO / name
            if source.is_file():  # a file deleted in the working tree is still listed as cached
                (copy / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, copy / name)
    else:  # not a git checkout (an unpacked archive): everything but the outputs and the environment
        shutil.copytree(REPO, copy, symlinks=True,
                        ignore=shutil.ignore_patterns(".git", ".venv", "runs", "__pycache__", "*.egg-info"))
    if SHARED.is_dir():
        (root / "shared").symlink_to(SHARED, target_is_directory=True)
    (copy / ".venv").symlink_to(Path(sys.prefix), target_is_directory=True)
    return copy


def slow_if_it_starts_flare(block: ShellBlock) -> Any:
    """The block as a test case, marked slow (like every simulator or POC test) when it starts FLARE."""
    marks = [pytest.mark.slow, pytest.mark.heavy] if STARTS_FLARE.search("\n".join(block.commands)) else []
    return pytest.param(block, marks=marks, id=block.where)


@pytest.mark.parametrize("block", [slow_if_it_starts_flare(block) for block in RUNNABLE])
def test_runnable_block_runs_as_written(block: ShellBlock, tmp_path: Path) -> None:
    if "../shared" in block.script() and not SHARED.is_dir():
        pytest.skip(f"{SHARED} is absent: {block.where} reads ../shared/data; skipping.")
    copy = repository_copy(tmp_path)
    env = {**os.environ, "MEDFLARE_SMOKE": "1",
           "PATH": os.pathsep.join([str(Path(sys.prefix) / "bin"), os.environ.get("PATH", "")])}
    proc = subprocess.run(["bash", "-c", block.script()], cwd=copy, env=env, capture_output=True, text=True,
                          timeout=900, check=False)
    assert proc.returncode == 0, (f"{block.where} failed (exit {proc.returncode}) at its last traced command:\n"
                                  f"{proc.stdout[-3000:]}\n{proc.stderr[-4000:]}")
    if re.search(r"\bmedflare (run|compare)\b", block.script()):  # never a silent smoke-size result
        assert "MEDFLARE_SMOKE=1: a smoke-size run, not a result" in proc.stderr


def test_smoke_caps_each_run_and_says_so(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from medflare.console import run_options
    from medflare.console.cli import make_parser

    args = make_parser().parse_args(["run", "fedavg", "--rounds", "30", "--set", "train.max_steps=0",
                                     "--set", "train.local_epochs=1"])
    monkeypatch.delenv(run_options.SMOKE_ENV, raising=False)
    assert run_options.build_run_config(args).rounds == 30  # without the variable nothing changes
    run_options._note_once.cache_clear()
    monkeypatch.setenv(run_options.SMOKE_ENV, "1")
    run = run_options.build_run_config(args)
    assert (run.rounds, int(run.train["max_steps"]), int(run.train["local_epochs"])) == (2, 2, 1)
    assert "a smoke-size run, not a result (rounds=2, train.max_steps=2)" in capsys.readouterr().err
    small = make_parser().parse_args(["run", "fedavg", "--rounds", "1", "--max-steps", "1", "--local-epochs", "1"])
    assert run_options.build_run_config(small).rounds == 1  # already within the caps: kept, and no note
    assert capsys.readouterr().err == ""
