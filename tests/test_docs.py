"""docs/architecture.md's "Layout" promises every module under hpctrain/,
one line each: held against the tree, so a module added without its line
(or a line left for a module gone) fails here.

    .venv/bin/python -m pytest -q tests/test_docs.py
"""
import os
import re

from conftest import REPO


def layout_names(text):
    """The module paths the Layout block names: its tree of folders (`name/`)
    and modules (`name.py`), two spaces a level; a package's __main__.py
    may be named on its __init__.py line instead ("__main__.py: python -m ...")."""
    block = text[text.index("## Layout"):]
    block = block[block.index("```") + 3:]
    block = block[:block.index("```")]
    folders, named = [], set()
    for line in block.splitlines():
        m = re.match(r"( *)(\S+)", line)
        if not m or not m.group(2).endswith(("/", ".py")):
            continue
        folders = folders[:len(m.group(1)) // 2]
        name = m.group(2).rstrip("/")
        if m.group(2).endswith("/"):
            folders.append(name)
            named.add("/".join(folders + ["__init__.py"]))   # a package: its folder's line
        else:
            named.add("/".join(folders + [name]))
            if "__main__.py" in line[m.end():]:
                named.add("/".join(folders + ["__main__.py"]))
    return named


def test_every_module_under_hpctrain_has_its_line_in_the_architecture_layout():
    with open(os.path.join(REPO, "docs", "architecture.md")) as f:
        named = layout_names(f.read())
    modules = {os.path.relpath(os.path.join(root, name), REPO).replace(os.sep, "/")
               for root, _, files in os.walk(os.path.join(REPO, "hpctrain")) for name in files if name.endswith(".py")}
    assert sorted(modules - named) == [], "modules with no line in docs/architecture.md's Layout"
    assert sorted(m for m in named - modules if m.startswith("hpctrain/") and not m.endswith("__init__.py")) == [], \
        "lines in docs/architecture.md's Layout for modules that are gone"
