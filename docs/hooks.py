"""mkdocs hook (mkdocs.yml `hooks:`): files outside docs/ that a page shows, and the API reference's list of modules.

docs/benchmarks.md includes the top-level BENCHMARKS.md, whose picture is benchmarks/results/summary.png (a path
relative to the repository root, where BENCHMARKS.md lives): the site gets that file at the same path.
docs/api.md's `MODULES_MARKER` becomes one mkdocstrings block per module of the package (its docstring), so every
module the package has is on the page, and none that it no longer has."""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File

OUTSIDE_DOCS = ["benchmarks/results/summary.png"]
MODULES_MARKER = "<!-- every module's docstring -->"
PACKAGE = "lightning_bfpp"


def on_files(files, config):
    root = Path(config.config_file_path).parent
    for path in OUTSIDE_DOCS:
        files.append(File(path, src_dir=str(root), dest_dir=config.site_dir,
                          use_directory_urls=config.use_directory_urls))
    return files


def module_blocks(root: Path) -> str:
    """One mkdocstrings block (the docstring only) per module of the package, each part's modules together."""
    blocks = []
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if parts[-1] == "__main__":
            continue
        blocks.append(f"::: {name}\n    options:\n      heading_level: 3\n      members: false\n"
                      "      show_root_full_path: true\n")
    return "\n".join(blocks)


def on_page_markdown(markdown, page, config, files):
    if MODULES_MARKER in markdown:
        return markdown.replace(MODULES_MARKER, module_blocks(Path(config.config_file_path).parent))
    return markdown
