"""The package's import graph (every import statement, also inside functions): no circles, no module
importing a layer above it, the model blind to diffusion, the exported modelling code standalone, and
every module importable on its own in a fresh interpreter (issue 15)."""
import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "setdiff_mega"

# lowest first; a module may import its own layer and the ones below
LAYERS = [
    ("setdiff_mega.decoding", "setdiff_mega.compat"),
    ("setdiff_mega.hfmodel",),
    ("setdiff_mega", "setdiff_mega.config", "setdiff_mega.lifeline", "setdiff_mega.diffusion", "setdiff_mega.data",
     "setdiff_mega.tasks"),
    ("setdiff_mega.parallel",),
    ("setdiff_mega.model",),
    ("setdiff_mega.build",),
    ("setdiff_mega.checkpoint",),
    ("setdiff_mega.training", "setdiff_mega.inference", "setdiff_mega.resilience"),
    ("setdiff_mega.eval", "setdiff_mega.serving"),
    ("setdiff_mega.cli", "setdiff_mega.train", "setdiff_mega.serve", "setdiff_mega.supervise"),
]


def _modules() -> dict:
    out = {}
    for f in PKG.rglob("*.py"):
        parts = f.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = f
    return out


def _graph(mods: dict) -> dict:
    edges = {}
    for name, f in mods.items():
        pkg = name if f.name == "__init__.py" else name.rsplit(".", 1)[0]
        found = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = pkg.split(".")[:len(pkg.split(".")) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in mods]
                cands = subs if len(subs) == len(node.names) else [target, *subs]
            elif isinstance(node, ast.Import):
                cands = [a.name for a in node.names]
            else:
                continue
            found |= {c for c in cands if c in mods and c != name}
        edges[name] = found
    return edges


def _absolute_imports(tree):
    """(import node, the top-level package names it imports) of every absolute import in ``tree``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield node, [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            yield node, [node.module.split(".")[0]]


def _layer(name: str) -> int:
    best = None
    for i, group in enumerate(LAYERS):
        for prefix in group:
            if name == prefix or name.startswith(prefix + "."):
                if best is None or len(prefix) > best[1]:
                    best = (i, len(prefix))
    assert best is not None, f"{name} is in no layer: add it to LAYERS"
    return best[0]


def _cycles(edges: dict) -> list:
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))
    for v in edges:
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_and_no_upward_import():
    edges = _graph(_modules())
    assert len(edges) > 60
    assert _cycles(edges) == []
    upward = sorted((a, b) for a, bs in edges.items() for b in bs if _layer(b) > _layer(a))
    assert upward == [], upward


def test_the_library_never_imports_the_studies_or_the_benchmarks():
    """experiments/ and benchmarks/ sit above everything (they are not installed); nothing in the package may
    import them, and their own imports of the package are whatever they need."""
    studies = {"experiments", "benchmarks"}
    offenders = []
    for f in sorted(PKG.rglob("*.py")):
        for node, tops in _absolute_imports(ast.parse(f.read_text())):
            offenders += [f"{f.relative_to(ROOT)}:{node.lineno}" for t in tops if t in studies]
    assert offenders == []
    for d in studies:
        assert (ROOT / d / "__init__.py").is_file(), d


def test_the_model_knows_nothing_about_diffusion_and_the_exported_code_stands_alone():
    edges = _graph(_modules())
    for a, bs in edges.items():
        if a.startswith("setdiff_mega.model"):
            assert not any(b.startswith(("setdiff_mega.diffusion", "setdiff_mega.training")) for b in bs), (a, bs)
        if a.startswith("setdiff_mega.diffusion"):
            assert not any(b.startswith("setdiff_mega.model") for b in bs), (a, bs)
        if a.startswith("setdiff_mega.decoding."):           # copied into every Hugging Face export
            assert all(b.startswith("setdiff_mega.decoding.") for b in bs), (a, bs)
        if a.startswith("setdiff_mega.hfmodel."):            # ditto, next to the decoding files
            assert all(b.startswith(("setdiff_mega.hfmodel.", "setdiff_mega.decoding.")) for b in bs), (a, bs)


def test_every_module_imports_in_a_fresh_interpreter():
    studies = [".".join(f.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
               for d in ("experiments", "benchmarks") for f in (ROOT / d).rglob("*.py")]
    names = sorted(_modules()) + sorted(studies)
    code = ("import importlib, sys\nfor n in sys.argv[1:]:\n    importlib.import_module(n)\n"
            "print('ok', len(sys.argv) - 1)")
    r = subprocess.run([sys.executable, "-c", code, *names], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == f"ok {len(names)}", r.stderr[-3000:]


def test_the_standalone_code_imports_only_torch_transformers_and_the_standard_library():
    """setdiff_mega/decoding and setdiff_mega/hfmodel are the remote code of every export: nothing else may be
    needed to run it."""
    allowed = set(sys.stdlib_module_names) | {"torch", "transformers", "safetensors"}
    optional = {"torchao",          # an opt-in format (decode_weights='int8'): imported under `except ImportError`
                "re2"}              # google-re2 for stop_regex, under `except ImportError` (stopping.py: re without it)
    for f in sorted([*(PKG / "decoding").glob("*.py"), *(PKG / "hfmodel").glob("*.py")]):
        tree = ast.parse(f.read_text())
        guarded = {id(n) for t in ast.walk(tree) if isinstance(t, ast.Try)
                   and any(isinstance(h.type, ast.Name) and h.type.id == "ImportError" for h in t.handlers)
                   for stmt in t.body for n in ast.walk(stmt)}
        for node, tops in _absolute_imports(tree):
            ok = allowed | (optional if id(node) in guarded else set())
            assert set(tops) <= ok, f"{f.name} imports {tops}"


# files whose tables of these strings are an outside file format's vocabulary, not the registry's names (homonyms)
FORMATS = {"setdiff_mega/checkpoint/adapters/dit.py": "the reference releases' config.json model_type values"}


def _name_tables(tree, names: set) -> list:
    """(line, names) of every dict keyed by, comparison with, or table of ``names``: a tuple / list / set of two
    or more of them, a dict with two or more as keys or as values (a comparison's literal counts by its members:
    ``method in ("bd3lm", "mdlm")``)."""
    found = {}
    for node in ast.walk(tree):
        keys, tables = [], []
        if isinstance(node, ast.Compare):
            keys = [e for k in [node.left, *node.comparators]
                    for e in (k.elts if isinstance(k, (ast.Tuple, ast.List, ast.Set)) else [k])]
        elif isinstance(node, ast.Dict):
            keys, tables = node.keys, [node.keys, node.values]
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            tables = [node.elts]
        named = [[e.value for e in t if isinstance(e, ast.Constant) and e.value in names] for t in tables]
        hit = [k.value for k in keys if isinstance(k, ast.Constant) and k.value in names]
        about = ast.unparse(node)           # a name of one of the registries' things, not a homonym
        if any(len(t) >= 2 for t in named):
            found[node.lineno] = max(named, key=len)
        elif hit and any(w in about for w in ("objective", "backend", "method", "name")):
            found[node.lineno] = hit
    return sorted(found.items())


def test_the_name_table_check_catches_dicts_comparisons_and_literal_tables():
    names = {"ar", "mdlm", "bd3lm", "setdlm"}
    src = ("if method in ('bd3lm', 'mdlm'):\n    pass\nMETHOD_OF = {'ARSampler': 'ar', 'MDLMSampler': 'mdlm'}\n"
           "SAMPLERS = {'ar': 1, 'setdlm': 2}\nBLOCKS = ['bd3lm', 'mdlm']\nok = objective.name == 'ar'\n"
           "fine = ('ar', 'x')\nalso_fine = {'car': 1}\n")
    assert [line for line, _ in _name_tables(ast.parse(src), names)] == [1, 3, 4, 5, 6]


def test_modules_stay_small_and_no_name_keyed_tables_outside_the_registries():
    """Issue 29's limits: no module over 400 lines, no function over 80, and no dict or comparison keyed by an
    objective or attention-backend name (nor a tuple / list / set of them) outside the registries and the
    methods' own modules."""
    import setdiff_mega.diffusion  # noqa: F401  (registers every method: alone, the registry would be empty)
    from setdiff_mega import backends, methods

    names = set(methods.names()) | set(backends.names())
    assert {"ar", "mdlm", "bd3lm", "setdlm"} <= names, names
    owners = {"setdiff_mega/methods.py", "setdiff_mega/backends.py"} | \
        {f"setdiff_mega/diffusion/{m}.py" for m in ("ar", "mdlm", "bd3lm", "setdlm")} | set(FORMATS)
    offenders = []
    for f in sorted([*PKG.rglob("*.py"), *(ROOT / "tools").glob("*.py"), *(ROOT / "experiments").rglob("*.py"),
                     *(ROOT / "benchmarks").rglob("*.py")]):
        rel = str(f.relative_to(ROOT))
        src = f.read_text()
        assert len(src.splitlines()) <= 400, f"{rel} has {len(src.splitlines())} lines"
        tree = ast.parse(src)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert node.end_lineno - node.lineno < 80, f"{rel}:{node.lineno} {node.name} is over 80 lines"
        if rel not in owners:
            offenders += [f"{rel}:{line} {hit}" for line, hit in _name_tables(tree, names)]
    assert offenders == []
