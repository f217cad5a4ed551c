"""mkdocs hook (mkdocs.yml `hooks:`): files outside docs/ that a page shows.

docs/benchmarks.md includes the top-level BENCHMARKS.md, whose picture is benchmarks/results/summary.png (a path
relative to the repository root, where BENCHMARKS.md lives): the site gets that file at the same path."""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File

OUTSIDE_DOCS = ["benchmarks/results/summary.png"]


def on_files(files, config):
    root = Path(config.config_file_path).parent
    for path in OUTSIDE_DOCS:
        files.append(File(path, src_dir=str(root), dest_dir=config.site_dir, use_directory_urls=config.use_directory_urls))
    return files
