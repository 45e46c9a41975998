"""The documentation stays true to the repository.

- docs/architecture.md's code map names every module that exists, and nothing else;
- links between the pages, and the files and test ids the pages name, exist;
- a refusal a page quotes ("refused: `message`") is still what the code says;
- every command shown in README.md and docs/ parses with the parser of the program it runs: train.py's
  own arguments and the project's config loader (plus the layout check for the launched world size),
  each tool's argparse, torchrun's own parser, the extras pip is asked for. Nothing is trained: this is
  the cheap half of "runs as written"; the commands themselves were run by hand.

A command that cannot be checked this way (a program outside the project, a file a run writes) is in
NOT_DRY_RUN with the reason; a new kind of command fails here until it is checked or listed there.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import io
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.test_layering import PACKAGES

PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
CODE_MAP = ROOT / "docs" / "architecture.md"
CODE_MAP_SECTION = "## Where things are"

# Programs and commands that the dry run cannot check, each with the reason.
NOT_DRY_RUN = {
    "tensorboard": "TensorBoard's own viewer (the logging extra installs it); it reads a run's event files",
    "nsys": "NVIDIA Nsight Systems, a GPU machine's profiler outside Python",
    "nvidia-smi": "the NVIDIA driver's tool; it needs a GPU",
    "python runs/tiny/checkpoints/step_00000600/zero_to_fp32.py":
        "DeepSpeed writes this script into each ZeRO checkpoint; it exists only after a ZeRO run",
}


# ----------------------------------------------------------------------------- the code map


def mapped_paths() -> set[str]:
    """The paths in the first column of the code map's tables."""
    text = CODE_MAP.read_text()
    assert CODE_MAP_SECTION in text, f"{CODE_MAP.name} has no '{CODE_MAP_SECTION}' section"
    section = text.split(CODE_MAP_SECTION, 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `([^`]+)` \|", section, flags=re.M))


def project_modules() -> set[str]:
    """Every module of the packages (package markers aside), train.py, and the scripts in tools/."""
    found = {"train.py"}
    for package in PACKAGES:
        if (ROOT / package).is_dir():
            found |= {str(p.relative_to(ROOT)) for p in (ROOT / package).rglob("*.py") if p.name != "__init__.py"}
    found |= {str(p.relative_to(ROOT)) for pattern in ("*.sh", "*.sbatch") for p in (ROOT / "tools").glob(pattern)}
    return found


def test_the_code_map_names_every_module():
    missing = sorted(project_modules() - mapped_paths())
    assert not missing, (f"{CODE_MAP.relative_to(ROOT)} ('{CODE_MAP_SECTION}') does not name "
                         f"{', '.join(missing)}: add a row for each")


def test_the_code_map_names_only_modules_that_exist():
    stale = sorted(p for p in mapped_paths() if not (ROOT / p).is_file())
    assert not stale, f"{CODE_MAP.relative_to(ROOT)} names {', '.join(stale)}, which do not exist: remove or rename them"


# ----------------------------------------------------------------------------- links and named files


def prose(page: Path) -> str:
    """A page's text without its fenced code blocks."""
    return re.sub(r"```.*?```", "", page.read_text(), flags=re.S)


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = prose(page)
    return {slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}


def links(page: Path) -> list[str]:
    text = prose(page)
    return [t for t in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"[a-z]+:", t)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_reach_a_file_and_a_heading(page):
    bad = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            bad.append(f"{target} (no such file)")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            bad.append(f"{target} (no heading with that anchor in {file.relative_to(ROOT)})")
    assert not bad, f"{page.relative_to(ROOT)}: " + "; ".join(bad)


NAMED = re.compile(r"^((?:common|kernels|model|data|parallel|training|analysis|tools|tests|configs|docs)/"
                   r"[\w./-]+\.(?:py|yaml|md|json|sh|sbatch|png|jsonl))(?:::(\w+))?(?::\w+)?$")


def named_files(page: Path) -> list[tuple[str, str | None]]:
    """Repository files named in code spans, with the test function named after '::'."""
    spans = re.findall(r"`([^`\n]+)`", prose(page))
    return [(m.group(1), m.group(2)) for m in map(NAMED.match, spans) if m]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_named_files_and_tests_exist(page):
    bad = []
    for path, test in named_files(page):
        file = ROOT / path
        if not file.is_file():
            bad.append(f"{path} (no such file)")
        elif test and not re.search(rf"^\s*def {test}\(", file.read_text(), flags=re.M):
            bad.append(f"{path}::{test} (no such test)")
    assert not bad, f"{page.relative_to(ROOT)} names " + "; ".join(bad)


# ----------------------------------------------------------------------------- quoted refusals

REFUSAL = re.compile(r"refused: `([^`\n]+)`")
ELIDED = "..."  # where a quoted refusal leaves out the run's values (an f-string's fields) or words
SHORTEST_QUOTE = 20  # a quote must keep a fragment at least this long: "`...`" alone would match anything


def code_text() -> str:
    """Every Python source of the project, with string literals continued on the next line joined (a
    message split over lines in the code is one line to the user)."""
    files = [ROOT / "train.py", *(p for package in PACKAGES if (ROOT / package).is_dir()
                                  for p in sorted((ROOT / package).rglob("*.py")))]
    return "\n".join(re.sub(r"[\"']\s*\n\s*[rRbBfF]*[\"']", "", f.read_text()) for f in files)


@pytest.fixture(scope="module")
def code() -> str:
    return code_text()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_quoted_refusals_are_in_the_code(page, code):
    """A page quoting a refusal ("refused: `message`") quotes what the code still says, '...' standing
    for the values and words it leaves out: each piece between them appears in the code, in order."""
    bad = []
    for quote in REFUSAL.findall(prose(page)):
        pieces = [piece.strip() for piece in quote.split(ELIDED) if piece.strip()]
        if not pieces or max(map(len, pieces)) < SHORTEST_QUOTE:
            bad.append(f"{quote!r} (quotes too little to find)")
            continue
        start = code.find(pieces[0])
        while start != -1 and not _in_order(code, pieces, start):
            start = code.find(pieces[0], start + 1)
        if start == -1:
            bad.append(f"{quote!r} (not in the code: copy the message as it is now)")
    assert not bad, f"{page.relative_to(ROOT)} quotes " + "; ".join(bad)


def _in_order(code: str, pieces: list[str], start: int) -> bool:
    """Whether ``pieces`` follow each other from ``start`` within one line of the joined code."""
    line_end = code.find("\n", start)
    line = code[start:line_end if line_end != -1 else len(code)]
    at = 0
    for piece in pieces:
        at = line.find(piece, at)
        if at == -1:
            return False
        at += len(piece)
    return True


# ----------------------------------------------------------------------------- commands

# Shell built-ins and utilities around the commands (a server in the background, a filter): nothing of
# the project to check in them.
SHELL_UTILITIES = ("export", "kill", "sleep", "grep")
PROGRAMS = ("python", "torchrun", "pip", "bash", "tools/profile.sh", *SHELL_UTILITIES, *NOT_DRY_RUN)


@dataclass(frozen=True)
class Command:
    page: str
    text: str
    in_prose: bool = False  # a code span in the text, where `python -m tools.x` alone names the tool

    def __str__(self) -> str:
        return f"{self.page}: {self.text}"


def _without_env(text: str) -> str:
    """A command line without its leading VAR=value assignments."""
    return re.sub(r"^(?:[A-Z_][A-Z0-9_]*=\S* +)+", "", text)


def _starts_a_command(text: str) -> bool:
    text = _without_env(text)
    return any(text == p or text.startswith(p + " ") for p in PROGRAMS)


def commands(page: Path) -> list[Command]:
    """Shell commands shown on a page: every line of a bash block (continuations joined), '$ ' lines
    and lines that start with a known program in other blocks, and code spans in the text that start
    with one (spans holding a placeholder, '<...>' or '...', are prose about a command, not one)."""
    name, text = str(page.relative_to(ROOT)), page.read_text()
    found = []
    for info, body in re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.S | re.M):
        for line in body.replace("\\\n", " ").split("\n"):
            line = line.strip()
            shown = line[2:] if line.startswith("$ ") else line
            if not shown or shown.startswith("#"):
                continue
            if info == "bash" or line.startswith("$ ") or _starts_a_command(shown):
                found.append(Command(name, shown))
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    for span in re.findall(r"`([^`]+)`", prose):
        span = " ".join(span.split())
        if _starts_a_command(span) and " " in _without_env(span) and "<" not in span and "..." not in span:
            found.append(Command(name, span, in_prose=True))
    return found


ALL_COMMANDS = [c for page in PAGES for c in commands(page)]


class DryRunError(Exception):
    pass


def _captured(call):
    """Run an argparse-driven call; a usage error becomes a DryRunError with the parser's message."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            return call()
    except SystemExit as exc:
        if exc.code in (0, None):  # --help
            return None
        raise DryRunError(err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else f"exit {exc.code}")


def check_config(config: str | None, overrides: list[str]):
    from training.config import load_config

    if config is not None and not (ROOT / config).is_file():
        raise DryRunError(f"no config file {config}")
    return load_config(config, overrides)


def check_layout(cfg, world_size: int, ranks_per_node: int, monkeypatch) -> None:
    """The layout check train.py runs before its process group starts, for the launched ranks."""
    from parallel.distributed import layout_from_env

    env = {"WORLD_SIZE": world_size, "LOCAL_WORLD_SIZE": ranks_per_node, "RANK": 0, "LOCAL_RANK": 0}
    with monkeypatch.context() as m:
        for key, value in env.items():
            m.setenv(key, str(value))
        layout_from_env(cfg.parallel)  # the run's Layout: every layout rule, the strategy resolved


def dry_run_train(argv: list[str], monkeypatch, world_size: int = 1, ranks_per_node: int = 1) -> None:
    import train

    parsed = _captured(lambda: train.parse_args(argv))
    if parsed is None or parsed[0].help_config:
        return
    args, overrides = parsed
    cfg = check_config(args.config, overrides + ([f"--checkpoint.resume={args.resume}"] if args.resume else []))
    check_layout(cfg, world_size, ranks_per_node, monkeypatch)


class _Parsed(Exception):
    def __init__(self, result):
        self.result = result


def dry_run_tool(name: str, argv: list[str], monkeypatch) -> None:
    """The tool's own parse: its parse_args where it has one, else its main stopped right after the
    parser returns. A --config it names is loaded with the --section.key=value arguments it leaves."""
    if importlib.util.find_spec(f"tools.{name}") is None:
        raise DryRunError(f"no module tools.{name}")
    module = importlib.import_module(f"tools.{name}")
    if hasattr(module, "parse_args"):
        result = _captured(lambda: module.parse_args(argv))
    else:
        original = argparse.ArgumentParser.parse_known_args

        def stop_after_parsing(self, args=None, namespace=None):
            raise _Parsed(original(self, args, namespace))

        with monkeypatch.context() as m:
            m.setattr(argparse.ArgumentParser, "parse_known_args", stop_after_parsing)
            try:
                result = _captured(lambda: module.main(argv))
            except _Parsed as parsed:
                result = parsed.result
    if result is None:
        return
    args, extra = result if isinstance(result, tuple) else (result, [])
    if getattr(args, "config", None):
        check_config(args.config, [e for e in extra if e.startswith("--") and "=" in e])


def dry_run_torchrun(argv: list[str], monkeypatch) -> None:
    from torch.distributed.run import get_args_parser

    args = _captured(lambda: get_args_parser().parse_args(argv))
    if args is None:
        return
    ranks_per_node = int(args.nproc_per_node)
    nodes = int(str(args.nnodes).split(":")[-1])
    script_argv = list(args.training_script_args)
    if args.module:
        if not args.training_script.startswith("tools."):
            raise DryRunError(f"torchrun -m {args.training_script}: only the project's tools are checked")
        dry_run_tool(args.training_script.removeprefix("tools."), script_argv, monkeypatch)
    elif args.training_script == "train.py":
        dry_run_train(script_argv, monkeypatch, nodes * ranks_per_node, ranks_per_node)
    else:
        raise DryRunError(f"torchrun {args.training_script}: not a script of this project")


def dry_run_pip(argv: list[str]) -> None:
    # tomllib is Python 3.11+; the project supports 3.10, and the section is plain "name = [" lines
    section = (ROOT / "pyproject.toml").read_text().split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    extras = set(re.findall(r"^([\w-]+) = \[", section, flags=re.M))
    if argv[:1] != ["install"]:
        raise DryRunError("only 'pip install' is checked")
    for arg in argv[1:]:
        match = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", arg)
        if match and match.group(1):
            unknown = set(match.group(1).split(",")) - extras
            if unknown:
                raise DryRunError(f"pyproject.toml has no extra {', '.join(sorted(unknown))}")


def dry_run_profile_sh(argv: list[str], monkeypatch) -> None:
    """tools/profile.sh's options (its usage text), then its CONFIG and overrides as train.py reads them."""
    config, overrides, nproc, rest = None, [], 1, list(argv)
    while rest:
        arg = rest.pop(0)
        if arg in ("-n", "--nproc"):
            nproc = int(rest.pop(0))
        elif arg == "--steps":
            int(rest.pop(0))
        elif arg in ("--nccl-debug", "--no-snapshot", "-h", "--help"):
            pass
        elif arg.startswith("--") and "=" in arg:
            overrides.append(arg)
        elif arg.startswith("-"):
            raise DryRunError(f"tools/profile.sh has no option {arg}")
        else:
            config = arg
    dry_run_train(["--config", config, *overrides], monkeypatch, nproc, nproc)


def dry_run(command: Command, monkeypatch) -> None:
    tokens = shlex.split(command.text, comments=True)
    parts = [[]]
    for token in tokens:
        if token in ("&&", "&", ";", "|"):
            parts.append([])
        else:
            parts[-1].append(token)
    for words in parts:
        while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
            words = words[1:]
        program, argv = words[0], words[1:]
        for key in NOT_DRY_RUN:
            if shlex.join(words).startswith(key):
                return
        if program in SHELL_UTILITIES:
            continue
        if program == "pip":
            dry_run_pip(argv)
        elif program == "torchrun":
            dry_run_torchrun(argv, monkeypatch)
        elif program == "tools/profile.sh":
            dry_run_profile_sh(argv, monkeypatch)
        elif program == "bash":
            if not (ROOT / argv[0]).is_file():
                raise DryRunError(f"no script {argv[0]}")
            if argv[0] == "tools/profile.sh":
                dry_run_profile_sh(argv[1:], monkeypatch)
        elif program == "python" and argv[:1] == ["train.py"]:
            dry_run_train(argv[1:], monkeypatch)
        elif program == "python" and len(argv) == 2 and argv[0] == "-m" and command.in_prose:
            if importlib.util.find_spec(argv[1]) is None:  # the tool named in the text
                raise DryRunError(f"no module {argv[1]}")
        elif program == "python" and argv[:1] == ["-m"] and argv[1].startswith("tools."):
            dry_run_tool(argv[1].removeprefix("tools."), argv[2:], monkeypatch)
        elif program == "python" and argv[:2] == ["-m", "pytest"]:
            missing = [a for a in argv[2:] if a.startswith("tests/") and not (ROOT / a.split("::")[0]).exists()]
            if missing:
                raise DryRunError(f"no test path {missing[0]}")
        elif program == "python" and argv[:1] == ["-m"]:
            if importlib.util.find_spec(argv[1]) is None:
                raise DryRunError(f"no module {argv[1]}")
        else:
            raise DryRunError(f"no dry run for '{program} {' '.join(argv[:1])}': check it here or list it in NOT_DRY_RUN")


@pytest.mark.parametrize("command", ALL_COMMANDS, ids=str)
def test_every_shown_command_parses(command, monkeypatch):
    try:
        dry_run(command, monkeypatch)
    except Exception as exc:  # a config error or a parser's usage line: say which command
        pytest.fail(f"{command}\n  -> {type(exc).__name__}: {exc}")


def test_the_commands_are_found():
    """The extraction itself: the README's set-up, a continued line and a shown '$ ' line."""
    shown = {c.text for c in ALL_COMMANDS}
    ci = (ROOT / ".ci" / "run").read_text()
    ci_tests = " && ".join(line.strip() for line in ci.splitlines() if line.strip().startswith("python -m pytest"))
    assert f'pip install torch==2.13.0 -e ".[dev]" && {ci_tests}' in shown, "the README's test command is not .ci/run's"
    assert 'pip install torch==2.13.0 -e ".[dev]" && python train.py --config configs/tiny.yaml' in shown
    assert any(c.startswith("torchrun --nnodes=2") and "train.py" in c for c in shown)
    assert any(c.startswith("python -m tools.sample runs/tiny") and "--seed 3" in c for c in shown)


@pytest.mark.parametrize("text, error", [
    ("python train.py --config configs/tiny.yaml --train.max_step=5", "max_step"),
    ("python train.py --config configs/nope.yaml", "nope.yaml"),
    ("torchrun --standalone --nproc_per_node=2 train.py --config configs/tiny.yaml --parallel.tp=4",
     "does not divide the 2 ranks"),
    ("python -m tools.bench_parallel --strategies  --layouts cp2,cp4 --steps 5", "--strategies: expected one argument"),
    ("python -m tools.estimate --config configs/tiny.yaml --gpus", "--gpus"),
    ("python -m tools.trace_summary", "required"),
    ("python -m tools.nope --x", "tools.nope"),
    ('pip install -e ".[nope]"', "nope"),
    ("tools/profile.sh --steps 3 --fast configs/tiny.yaml", "--fast"),
])
def test_the_dry_run_rejects_what_would_not_run(text, error, monkeypatch):
    with pytest.raises(Exception, match=re.escape(error)):
        dry_run(Command("test", text), monkeypatch)


# ----------------------------------------------------------------------------- commands the results record


def test_benchmarks_record_the_command_as_it_was_typed(monkeypatch, tmp_path):
    """The 'Command:' line of a results file runs as written: an empty argument (--strategies '')
    stays quoted instead of vanishing and shifting the next flag into its place, a value with a space
    stays one argument."""
    from tools import bench_checkpoint, bench_parallel

    recorded = []
    monkeypatch.setattr(bench_parallel, "measure_all", lambda plan, progress=None: ([], {"precision": "fp32", "global_batch": 8}))
    for name in ("table", "comm_table", "cp_table", "ep_table"):
        monkeypatch.setattr(bench_parallel, name, lambda rows, markdown: "")
    monkeypatch.setattr(bench_parallel, "write_markdown", lambda rows, title, nproc, command, path: recorded.append(command))
    argv = ["--strategies", "", "--layouts", "cp2", "--markdown", str(tmp_path / "p.md")]
    bench_parallel.main(argv)
    assert shlex.split(recorded[-1]) == ["python", "-m", "tools.bench_parallel", *argv]

    monkeypatch.setattr(bench_checkpoint, "launch", lambda *args: None)
    monkeypatch.setattr(bench_checkpoint, "table", lambda rows, markdown: "")
    monkeypatch.setattr(bench_checkpoint, "write_markdown", lambda rows, command, rounds, path: recorded.append(command) or [])
    argv = ["--rounds", "1", "--markdown", str(tmp_path / "c.md"), "--", "--name=two words"]
    bench_checkpoint.main(argv)
    assert shlex.split(recorded[-1]) == ["python", "-m", "tools.bench_checkpoint", *argv]
