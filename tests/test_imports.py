"""How the installed package's modules import each other: read from their
source (imports inside functions too), never by importing them. No module
may reach itself through others (an import circle), and what runs inside
the inference server imports nothing of the agent's, nor bcc, nor click."""

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

PACKAGES = ("mmtrace.agent", "mmtrace.bpf", "mmtrace.detectors", "mmtrace.exporters",
            "mmtrace.dispatch")
# What an inference server imports (interface.md: importable without root or bcc).
SERVER_SIDE = ("mmtrace.dispatch", "mmtrace.detectors.attention_entropy")


def modules() -> dict[str, Path]:
    """Every module of the installed packages: dotted name -> source file."""
    found = {}
    for package in PACKAGES:
        spec = importlib.util.find_spec(package)
        assert spec is not None and spec.submodule_search_locations, package
        for folder in map(Path, spec.submodule_search_locations):
            for source in sorted(folder.rglob("*.py")):
                parts = source.relative_to(folder).with_suffix("").parts
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                found[".".join((package, *parts))] = source
    return found


def imported(name: str, source: Path, known: dict) -> set[str]:
    """The project's modules `name` imports, wherever in the file."""
    package = name if source.stem == "__init__" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(source.read_text(), str(source))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            # `from pkg import mod` imports the module; `from mod import x`, mod
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        else:
            continue
        out.update(t for t in targets if t in known and t != name)
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imported(name, source, known) for name, source in known.items()}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected parts of more than one module (Tarjan's)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_itself_through_others():
    edges = graph()
    assert len(edges) > 100 and "mmtrace.agent.daemon.loop" in edges    # every module was read
    assert "mmtrace.bpf.device" in edges["mmtrace.agent.daemon.streams"]   # and its imports seen
    found = circles(edges)
    assert not found, "import circles: " + "; ".join(" -> ".join(c) for c in found)


def test_the_circle_finder_finds_a_circle_and_imports_inside_functions(tmp_path):
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(edges) == [["a", "b", "c"]]
    source = tmp_path / "a.py"
    source.write_text("def f():\n    from .b import x\n    from . import c\n")
    known = {"p.a": source, "p.b": source, "p.c": source}
    assert imported("p.a", source, known) == {"p.b", "p.c"}


def test_the_server_side_modules_load_without_the_agent_bcc_or_click():
    dispatch = importlib.util.find_spec("mmtrace.dispatch").submodule_search_locations[0]
    wanted = [*SERVER_SIDE] + [f"mmtrace.dispatch.{p.stem}" for p in Path(dispatch).glob("*.py")
                               if p.stem != "__init__"]
    code = ("import importlib, json, sys\n"
            f"for name in {wanted!r}: importlib.import_module(name)\n"
            "print(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    loaded = __import__("json").loads(out.stdout)
    assert "mmtrace.dispatch.dispatcher" in loaded and "torch" in loaded
    unwanted = [m for m in loaded if m.startswith(("mmtrace.agent", "mmtrace.exporters",
                                                   "mmtrace.bpf"))
                or m.split(".")[0] in ("bcc", "click")]
    assert not unwanted, f"the server side pulls in {unwanted}"


# The declared layer order, lowest first: a module may import its own layer and
# those below it, never one above. A module belongs to the layer of the longest
# prefix that names it. This is design.md's diagram, read bottom up.
LAYERS = (
    ("mmtrace.dispatch",),                       # runs inside the inference server
    ("mmtrace.detectors",),                      # usable live, over a recording, in-server
    ("mmtrace.bpf",),                            # the programs and their decoders
    ("mmtrace.exporters",),                      # render what they are handed
    ("mmtrace.agent", "mmtrace.agent.errors", "mmtrace.agent.findings",
     "mmtrace.agent.safe_files", "mmtrace.agent.bounded_json", "mmtrace.agent.heap",
     "mmtrace.agent.log_limit", "mmtrace.agent.priority", "mmtrace.agent.stop_flag"),
    ("mmtrace.agent.config",),
    ("mmtrace.agent.discovery",),
    ("mmtrace.agent.kernel",),                   # the only layer that imports bcc
    ("mmtrace.agent.ingest",),
    ("mmtrace.agent.socket",),
    ("mmtrace.agent.recording",),
    ("mmtrace.agent.daemon",),
    ("mmtrace.agent.doctor",),
    ("mmtrace.agent.mcp",),                      # a front end, as the CLI: recordings and the socket
    ("mmtrace.agent.cli", "mmtrace.agent.__main__"),
)


def layer_of(name: str, layers=LAYERS) -> int:
    best, depth = None, -1
    for level, prefixes in enumerate(layers):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and prefix.count(".") > depth:
                best, depth = level, prefix.count(".")
    assert best is not None, f"{name} is in no declared layer"
    return best


def upward(edges: dict[str, set[str]], layers=LAYERS) -> list[str]:
    return sorted(f"{a} -> {b}" for a, targets in edges.items() for b in targets
                  if layer_of(b, layers) > layer_of(a, layers))


def test_imports_point_down_the_declared_layers():
    found = upward(graph())
    assert not found, "imports up the layer order:\n" + "\n".join(found)


def test_the_layer_check_finds_an_upward_edge():
    layers = (("p.low",), ("p.high",))
    assert upward({"p.low.a": {"p.high.b"}, "p.high.b": {"p.low.a"}}, layers) == \
        ["p.low.a -> p.high.b"]
    assert layer_of("p.high.b.c", layers) == 1


def test_only_the_kernel_layer_imports_bcc():
    known = modules()
    found = []
    for name, source in known.items():
        for node in ast.walk(ast.parse(source.read_text(), str(source))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n == "bcc" or n.startswith("bcc.") for n in names) and \
                    not name.startswith("mmtrace.agent.kernel."):
                found.append(name)
    assert not found, f"bcc imported outside agent/kernel: {sorted(set(found))}"
