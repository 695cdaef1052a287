"""Backticked file paths and nexttoken names in docs and code comments that do not exist in the tree."""
import ast, re, sys
from pathlib import Path

ROOT = Path(sys.argv[1]).resolve()
files = [p for p in ROOT.rglob("*") if p.is_file() and ".git" not in p.parts and ".venv" not in p.parts
         and p.suffix in (".py", ".md", ".cpp", ".h", ".toml", ".sh", ".js", ".html")]
all_paths = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if ".git" not in p.parts]
# every name defined in the package: modules, classes, functions, attributes, methods
defined = set()
modules = set()
for p in (ROOT / "nexttoken").rglob("*.py"):
    modules.add(p.stem)
    modules.update(p.relative_to(ROOT).with_suffix("").parts)
    try:
        tree = ast.parse(p.read_text())
    except SyntaxError:
        continue
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(n.name)
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            defined.add(n.id)
        elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
            defined.add(n.attr)
        elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            defined.add(n.target.id)
        elif isinstance(n, ast.arg):
            defined.add(n.arg)
        elif isinstance(n, ast.alias):
            defined.add((n.asname or n.name).split(".")[-1])
classes = {n for n in defined if n[:1].isupper()}
PATH = re.compile(r"^[\w./-]*\w\.(py|md|cpp|h|sh|jinja|json)$")
DOTTED = re.compile(r"^([A-Za-z_]\w*)(\.[A-Za-z_]\w*)+(\(\))?$")
def texts(p):
    s = p.read_text(errors="replace")
    if p.suffix == ".py":  # comments and string literals only
        out = [m.group(0) for m in re.finditer(r"#.*", s)]
        try:
            for n in ast.walk(ast.parse(s)):
                if isinstance(n, ast.Constant) and isinstance(n.value, str):
                    out.append(n.value)
        except SyntaxError:
            pass
        return "\n".join(out)
    return s
for p in sorted(files):
    rel = p.relative_to(ROOT)
    for m in re.finditer(r"`([^`\n]{2,120})`", texts(p)):
        tok = m.group(1).strip()
        if PATH.match(tok):
            t = tok.lstrip("./")
            if t.startswith("shared/") or "*" in t or "{" in t or t.startswith("~"):
                continue
            if not any(a == t or a.endswith("/" + t) for a in all_paths):
                print(f"{rel}: path `{tok}`")
        elif DOTTED.match(tok):
            parts = tok.removesuffix("()").split(".")
            if parts[0] not in modules and parts[0] not in classes and parts[0] != "nexttoken":
                continue
            for name in parts[1:]:
                if name not in defined and name not in modules and name not in ("py", "md"):
                    print(f"{rel}: name `{tok}` ({name} undefined)")
                    break
print("--- unquoted .py mentions")
for p in sorted(files):
    rel = p.relative_to(ROOT)
    for m in re.finditer(r"(?<![\w./`-])((?:[\w-]+/)*[\w]+\.(?:py|cpp|h))\b", texts(p)):
        t = m.group(1)
        if not any(a == t or a.endswith("/" + t) for a in all_paths):
            print(f"{rel}: bare path {t}")
print("--- backticked calls")
for p in sorted(files):
    rel = p.relative_to(ROOT)
    for m in re.finditer(r"`([A-Za-z_]\w*)\(\)`|`([A-Za-z_]\w*)\([^`)]*\)`", texts(p)):
        name = m.group(1) or m.group(2)
        if name not in defined and name not in modules:
            print(f"{rel}: call `{name}()`")
print("--- dotted in comments (unquoted)")
for p in sorted(files):
    rel = p.relative_to(ROOT)
    for m in re.finditer(r"(?<![\w.`])([a-z_]\w*)\.([A-Za-z_]\w*)(?:\.([A-Za-z_]\w*))?\b", texts(p)):
        first = m.group(1)
        if first not in modules or first in ("self", "torch", "np", "os", "sys", "json", "re"):
            continue
        for name in filter(None, m.groups()[1:]):
            if name not in defined and name not in modules and name not in ("py", "md", "cpp", "h", "json", "gguf", "html", "png", "safetensors", "jinja", "txt", "js", "css", "com", "org", "io", "so"):
                print(f"{rel}: dotted {m.group(0)}")
                break
