"""The blocks the README and the docs pages mark runnable (`<!-- runnable -->` on the line before
the fence) run in a copy of the files a clone has: `make X` as `make -n X` (it would install,
serve or test), `tandem ...` through its argument parser, a Python block whole (it loads the
default model). A command, flag or name that is gone fails; nothing starts a server.
The repository paths the pages name in code spans exist too."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
RUNNABLE = re.compile(r"<!-- runnable -->\n```(bash|python)\n(.*?)```", re.S)
BLOCKS = [
    pytest.param(
        lang,
        block,
        id=f"{page.name}:{block.splitlines()[0][:50]}",
        marks=[pytest.mark.slow] if lang == "python" else [],
    )
    for page in PAGES
    for lang, block in RUNNABLE.findall(page.read_text())
]
REPO_PATH = re.compile(r"`((?:tandem|tests|examples|scripts|profiles|docs)/[\w./-]*)`")

# Run in the clone: parse each argv with the command line's own parser (--help exits 0).
PARSE = """
import json, sys
import tandem
from tandem.cli import build_parser
assert tandem.__file__.startswith(sys.argv[2]), tandem.__file__
for argv in json.loads(sys.argv[1]):
    try:
        build_parser(argv).parse_args(argv)
    except SystemExit as e:
        if e.code:
            sys.exit(f"does not parse: tandem {' '.join(argv)}")
"""


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """The files a commit would carry (tracked, or new and not ignored), in a folder alone."""
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout
    dest = tmp_path_factory.mktemp("clone") / "tandem"
    for name in filter(None, files.decode().split("\0")):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


def commands(block: str) -> list[list[str]]:
    """The simple commands of a shell block: continuations joined, comments dropped, split at
    `&&`, `||`, `|`, `;` and `&`, leading VAR=value assignments dropped."""
    tokens = []
    for line in block.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        tokens += [*lexer, ";"]
    found, current = [], []
    for token in tokens:
        if token in ("&&", "||", "|", ";", "&"):
            while current and re.fullmatch(r"\w+=.*", current[0]):
                current.pop(0)
            if current:
                found.append(current)
            current = []
        else:
            current.append(token)
    return found


def check(lang: str, block: str, clone: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(clone)}
    run = dict(cwd=clone, env=env, capture_output=True, text=True, timeout=300)
    if lang == "python":  # runs whole: the default model, a few seconds
        done = subprocess.run([sys.executable, "-c", block], **run)
        assert done.returncode == 0 and done.stdout.strip(), done.stderr[-3000:]
        return
    argvs = []
    for argv in commands(block):
        if argv[0] == "make":
            done = subprocess.run(["make", "-n", *argv[1:]], **run)
            assert done.returncode == 0, f"{' '.join(argv)}:\n{done.stderr[-3000:]}"
        elif Path(argv[0]).name == "tandem":
            argvs.append(argv[1:])
        else:
            raise AssertionError(f"a runnable block holds make and tandem commands only: {argv}")
    if argvs:
        done = subprocess.run([sys.executable, "-c", PARSE, json.dumps(argvs), str(clone)], **run)
        assert done.returncode == 0, done.stderr[-3000:]


def test_the_readme_and_getting_started_mark_runnable_blocks():
    for name in ("README.md", "getting-started.md"):
        assert any(name in p.id for p in BLOCKS), f"{name} has no runnable block"
    readme = (ROOT / "README.md").read_text()
    assert "make serve" in readme and "make test" in readme
    assert "../shared" not in readme and "~/.cache/peers" not in readme


@pytest.mark.parametrize("lang, block", BLOCKS)
def test_runnable_block(lang, block, clone):
    check(lang, block, clone)


@pytest.mark.parametrize(
    "lang, block",
    [
        ("bash", "make no-such-target"),
        ("bash", ".venv/bin/tandem no-such-command"),
        ("bash", ".venv/bin/tandem serve --no-such-flag 1"),
        ("bash", "curl -s 127.0.0.1:8000/health"),
        ("python", "from tandem import no_such_name"),
    ],
)
def test_a_command_that_is_gone_fails(lang, block, clone):
    with pytest.raises(AssertionError):
        check(lang, block, clone)


def test_the_paths_the_pages_name_exist():
    named = {(page.name, path) for page in PAGES for path in REPO_PATH.findall(page.read_text())}
    missing = sorted((page, path) for page, path in named if not (ROOT / path).exists())
    assert not missing, f"pages name paths that do not exist: {missing}"


def test_the_configuration_page_explains_every_flag_of_tandem_serve():
    """The page's tables are generated (docs/hooks/config_reference.py): the config's fields,
    then the flags no field declares. Each flag of `tandem serve` has a row there that says
    what it does: a field or a flag added without help text fails here."""
    import importlib.util

    from tandem.cli import build_parser

    spec = importlib.util.spec_from_file_location(
        "config_reference", ROOT / "docs/hooks/config_reference.py"
    )
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    page = hook.on_page_markdown((ROOT / "docs/configuration.md").read_text())
    assert hook.MARKER not in page and "### Scheduler" in page
    rows = {
        m.group(1): m.group(2).strip()
        for m in re.finditer(r"^\|.*?`(--[\w-]+)`.*\|([^|]*)\|$", page, re.M)
    }
    serve = build_parser(["serve"])._subparsers._group_actions[0].choices["serve"]
    flags = {
        a.option_strings[0]
        for a in serve._actions
        if a.option_strings and a.option_strings[0].startswith("--")
    } - {"--help"}
    unexplained = sorted(f for f in flags if not rows.get(f))
    assert not unexplained, (
        f"tandem serve flags with no entry or no words on the page: {unexplained}"
    )
