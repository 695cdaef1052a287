"""List references in docs and code comments to files or nexttoken names that no longer exist.

    python scripts/stale_references.py [ROOT]

Looks at backticked text in Markdown and in Python comments and strings: a `path.py` (or .md, .cpp, .h, .sh,
.json, .jinja) that no file of the tree ends with, and a dotted `module.name` / `Class.method` starting with a
nexttoken module or class whose later parts nexttoken never defines. External names (torch, gguf, llama.cpp's
files) show up too and are for a reader to dismiss; the output is a list to read, not a test.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

SUFFIXES = (".py", ".md", ".cpp", ".h", ".toml", ".sh", ".js", ".html")
PATH = re.compile(r"^[\w./-]*\w\.(py|md|cpp|h|sh|jinja|json)$")
DOTTED = re.compile(r"^([A-Za-z_]\w*)(\.[A-Za-z_]\w*)+(\(\))?$")


def defined_names(package: Path) -> tuple[set[str], set[str]]:
    """(every name the package defines or binds, every module / folder name in it)."""
    names, modules = set(), set()
    for path in package.rglob("*.py"):
        modules.update(path.relative_to(package.parent).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.alias):
                names.add((node.asname or node.name).split(".")[-1])
    return names, modules


def prose(path: Path) -> str:
    """A Markdown file whole; of a Python file, its comments and string literals."""
    text = path.read_text(errors="replace")
    if path.suffix != ".py":
        return text
    parts = re.findall(r"#.*", text)
    parts += [n.value for n in ast.walk(ast.parse(text)) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    return "\n".join(parts)


def stale(root: Path) -> list[str]:
    files = [p for p in root.rglob("*") if p.is_file() and p.suffix in SUFFIXES
             and not {".git", ".venv"} & set(p.relative_to(root).parts)]
    tree = [str(p.relative_to(root)) for p in root.rglob("*") if ".git" not in p.parts]
    names, modules = defined_names(root / "nexttoken")
    classes = {n for n in names if n[:1].isupper()}
    found = []
    for path in sorted(files):
        for match in re.finditer(r"`([^`\n]{2,120})`", prose(path)):
            ref = match.group(1).strip()
            if PATH.match(ref):
                name = ref.lstrip("./")
                if name.startswith(("shared/", "~")) or "*" in name or "{" in name:
                    continue
                if not any(t == name or t.endswith("/" + name) for t in tree):
                    found.append(f"{path.relative_to(root)}: no file `{ref}`")
            elif DOTTED.match(ref):
                parts = ref.removesuffix("()").split(".")
                if parts[0] not in modules | classes | {"nexttoken"}:
                    continue
                missing = next((p for p in parts[1:] if p not in names | modules | {"py", "md"}), None)
                if missing:
                    found.append(f"{path.relative_to(root)}: `{ref}` ({missing} is defined nowhere)")
    return found


if __name__ == "__main__":
    print("\n".join(stale(Path(sys.argv[1] if len(sys.argv) > 1 else ".").resolve())))
