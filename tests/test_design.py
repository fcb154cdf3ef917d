"""docs/design.md stays true to the code: its layout names every module of rawgpu/, and every module it names exists.

The layout is a block of lines `  name   what it does` by folder (two spaces of indent a level, the descriptions from
column 22). A module without a line of its own is named in its folder's description, by its stem (kernels/: gemm,
dx_sgd, ...).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DESCRIPTION_COLUMN = 22  # where the descriptions start: a line indented this far goes on the one before


def layout_block(text: str) -> list[str]:
    section = text[text.index("## Layout"):]
    return section.split("```", 2)[1].splitlines()[1:]


def named(lines: list[str]) -> tuple[set[Path], dict[Path, str]]:
    """(every path the layout names under rawgpu/, each folder's description text)."""
    paths: set[Path] = set()
    described: dict[Path, str] = {}
    folders: dict[int, Path] = {}
    last: Path | None = None
    for line in lines:
        indent = len(line) - len(line.lstrip(" "))
        tokens = line.split()
        names = []
        for token in tokens if indent < DESCRIPTION_COLUMN else ():
            if re.fullmatch(r"[\w./]+(\.py|/)", token):
                names.append(token)
            else:
                break
        rest = " ".join(tokens[len(names):])
        if not names:  # a description's next line
            if last is not None:
                described[last] = described.get(last, "") + " " + rest
            continue
        parent = Path(".") if indent == 0 else folders.get(indent - 2, Path("."))
        for name in names:
            path = parent / name.rstrip("/")
            if name.endswith("/"):
                folders[indent] = path
            paths.add(path)
        last = parent / names[-1].rstrip("/")
        described[last] = described.get(last, "") + " " + rest
    return {p for p in paths if p.parts and p.parts[0] == "rawgpu"}, described


def test_the_layout_names_every_module_and_every_module_it_names_exists():
    paths, described = named(layout_block((ROOT / "docs" / "design.md").read_text()))
    missing = sorted(str(p) for p in paths if not (ROOT / p).exists())
    assert not missing, f"docs/design.md names what is not there: {missing}"
    unnamed = []
    for module in sorted((ROOT / "rawgpu").rglob("*.py")):
        rel = module.relative_to(ROOT)
        if rel in paths or rel.name == "__init__.py" and rel.parent in paths:
            continue
        folder_text = described.get(rel.parent, "")
        if rel.parent in paths and re.search(rf"\b{rel.stem}\b", folder_text):
            continue  # named in its folder's description (kernels/, contract/, steps/)
        unnamed.append(str(rel))
    assert not unnamed, f"docs/design.md's layout does not name: {unnamed}"


def test_the_reader_sees_nested_folders_and_name_lists():
    lines = ["rawgpu/", "  a.py b.py           two at once", "  sub/                a folder of: one, two",
             "                      and more", "  deep/", "    x.py              in deep/"]
    paths, described = named(lines)
    assert paths == {Path("rawgpu"), Path("rawgpu/a.py"), Path("rawgpu/b.py"), Path("rawgpu/sub"),
                     Path("rawgpu/deep"), Path("rawgpu/deep/x.py")}
    assert "one, two and more" in described[Path("rawgpu/sub")]
