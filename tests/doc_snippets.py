"""The code blocks of the README and the documentation (README.md, BENCHMARKS.md, docs/*.md), as
tests/test_docs_snippets.py runs them: which blocks there are, how each is marked, and the command lines a
`run with:` mark turns into. Pure Python (no torch), so tests/conftest.py can count them for its summary.

Every ```python and ```bash block runs, unless the line right above its opening fence marks it:
<!-- not run: REASON -->     not run; the reason is required (a GPU cluster, SLURM, minutes of benchmarks, ...)
<!-- run with: OVERRIDES --> runs with these Hydra overrides on each command that runs a script of examples/:
an override replaces the command's own value of that key, or is appended, so a
block can show the real command (400 steps, 8 MB of data) and run in seconds.
Blocks of one file run in order in one directory (a later block may use an earlier one's files: an export
reads the checkpoint a training command wrote). A python block that starts with `>>>` runs as a doctest."""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LANGUAGES = ("python", "bash")
MISSPELT = {"py", "python3", "pycon", "sh", "shell", "console", "zsh"}  # blocks that would silently not run
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<lang>[\w+-]*)")
MARK = re.compile(r"^\s*<!--\s*(?P<kind>not[ -]run|run[ -]with)\b\s*:?\s*(?P<text>.*?)\s*-->\s*$", re.IGNORECASE)
EXAMPLE_SCRIPT = re.compile(r"(^|\s)examples/\w+\.py(\s|$)")


@dataclass(frozen=True)
class Block:
    file: str  # relative to the repository root
    line: int  # of the opening fence (1-based)
    lang: str
    code: str
    not_run: str | None = None  # the reason
    run_with: tuple[str, ...] = ()

    @property
    def id(self) -> str:
        return f"{self.file}:{self.line}"

    @property
    def doctest(self) -> bool:
        return self.lang == "python" and self.code.lstrip().startswith(">>>")


def doc_files(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", root / "BENCHMARKS.md", *sorted((root / "docs").glob("*.md"))]


def parse(path: Path, root: Path = ROOT) -> tuple[list[Block], list[str]]:
    """(python and bash blocks of `path`, errors in their marks)."""
    rel, lines = str(path.relative_to(root)), path.read_text().split("\n")
    blocks, errors, i = [], [], 0
    marks = {n: m for n, line in enumerate(lines) if (m := MARK.match(line))}  # line index -> mark
    used: set[int] = set()
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.group("indent"), m.group("fence"), m.group("lang").lower()
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip().startswith(fence[0] * len(fence))
                    and not lines[j].strip().strip(fence[0])), None)
        if end is None:
            errors.append(f"{rel}:{i + 1}: a code block that is never closed")
            break
        body = [line[len(indent):] if line.startswith(indent) else line.lstrip() for line in lines[i + 1:end]]
        mark = marks.get(i - 1)
        if lang in MISSPELT:
            errors.append(f"{rel}:{i + 1}: ```{lang} is neither run nor checked: write ```python or ```bash")
        elif lang in LANGUAGES:
            not_run, run_with = None, ()
            if mark is not None:
                used.add(i - 1)
                kind, text = mark.group("kind").lower().replace("-", " "), mark.group("text")
                if kind == "not run":
                    not_run = text
                    if not text:
                        errors.append(f"{rel}:{i}: `<!-- not run: REASON -->` needs the reason")
                else:
                    run_with = tuple(shlex.split(text))
                    if lang != "bash" or not run_with or not any(EXAMPLE_SCRIPT.search(c)
                                                                 for c in commands("\n".join(body))):
                        errors.append(f"{rel}:{i}: `<!-- run with: OVERRIDES -->` needs overrides and a bash block "
                                      "that runs a script of examples/")
            blocks.append(Block(rel, i + 1, lang, "\n".join(body) + "\n", not_run, run_with))
        i = end + 1
    for n in sorted(set(marks) - used):
        errors.append(f"{rel}:{n + 1}: a run mark must be the line right above a ```python or ```bash block")
    return blocks, errors


def collect(root: Path = ROOT) -> tuple[list[Block], list[str]]:
    blocks, errors = [], []
    for path in doc_files(root):
        b, e = parse(path, root)
        blocks += b
        errors += e
    return blocks, errors


def commands(script: str) -> list[str]:
    """The script's lines with `\\` continuations joined."""
    return script.replace("\\\n", " ").split("\n")


def split_comment(line: str) -> tuple[str, str]:
    """(command, `# comment` or "") of one shell line; a `#` counts outside quotes, at the start or after a blank."""
    quote = None
    for k, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (k == 0 or line[k - 1].isspace()):
            return line[:k].rstrip(), line[k:]
    return line.rstrip(), ""


def _key(token: str) -> str | None:
    if "=" not in token or token.startswith("-"):
        return None
    return token.split("=", 1)[0].lstrip("+~")


def with_overrides(script: str, overrides: tuple[str, ...]) -> str:
    """`script` with `overrides` given to every command that runs a script of examples/ (replacing the command's
    own value of a key, else appended); other lines unchanged."""
    out = []
    for line in commands(script):
        code, comment = split_comment(line)
        if EXAMPLE_SCRIPT.search(code):
            tokens = shlex.split(code)
            for override in overrides:
                same = [k for k, t in enumerate(tokens) if _key(t) is not None and _key(t) == _key(override)]
                if same:  # keep the command's `+` (a key Hydra adds) when the override has none
                    own = tokens[same[0]]
                    tokens[same[0]] = own[: len(own) - len(own.lstrip("+~"))] + override.lstrip("+~") \
                        if override == override.lstrip("+~") else override
                else:
                    tokens.append(override)
            code = shlex.join(tokens)
        out.append(f"{code}  {comment}" if comment and code else code or comment)
    return "\n".join(out)
