"""The import-layer rule (docs/architecture.md#layers): each package imports only itself and the layers
below it, and the torch-free layers never load torch, not even through what they import."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("worker", "cache", "gateway", "bench", "deploy")

# layer -> the layers (of ours) it may import besides itself, lowest first
WORKER_BASE = ("cache", "worker.formats", "worker.contract")
GATEWAY_BASE = (*WORKER_BASE, "gateway.policy", "gateway")
GATEWAY_DOMAIN = (*GATEWAY_BASE, "gateway.cluster", "gateway.registry", "gateway.tenancy")
GATEWAY_EDGE = (*GATEWAY_DOMAIN, "gateway.requests", "gateway.compose", "gateway.http")
ALLOWED: dict[str, tuple[str, ...]] = {
    "worker": (),  # worker/__init__.py: imports nothing
    "cache": (),
    "worker.formats": ("cache",),
    "worker.contract": ("cache", "worker.formats"),
    "worker.model": WORKER_BASE,
    "worker.lora": (*WORKER_BASE, "worker.model"),
    "worker.engine": (*WORKER_BASE, "worker.model", "worker.lora"),
    "worker.residency": (*WORKER_BASE, "worker.model", "worker.lora", "worker.engine"),
    "worker.shard": (*WORKER_BASE, "worker.model", "worker.lora", "worker.engine", "worker.residency"),
    "worker.cli": (*WORKER_BASE, "worker.model", "worker.lora", "worker.engine"),
    # the gateway, from its pure decisions up to the deployment (docs/architecture.md#the-gateway)
    "gateway.policy": WORKER_BASE,
    "gateway": (*WORKER_BASE, "gateway.policy"),  # config, errors, catalog, metrics, state store, tool calls
    "gateway.loadtest": (*WORKER_BASE, "gateway"),
    "gateway.cluster": GATEWAY_BASE,
    "gateway.registry": (*GATEWAY_BASE, "gateway.cluster"),
    "gateway.tenancy": (*GATEWAY_BASE, "gateway.cluster", "gateway.registry"),
    "gateway.requests": GATEWAY_DOMAIN,
    "gateway.compose": (*GATEWAY_DOMAIN, "gateway.requests"),
    "gateway.http": (*GATEWAY_DOMAIN, "gateway.requests", "gateway.compose"),
    "gateway.api.openai": GATEWAY_EDGE,
    "gateway.api.llama": (*GATEWAY_EDGE, "gateway.api.openai"),
    "gateway.api.anthropic": (*GATEWAY_EDGE, "gateway.api.openai"),
    "gateway.api.responses": (*GATEWAY_EDGE, "gateway.api.openai"),
    "gateway.api.admin": GATEWAY_EDGE,
    "gateway.api": (*GATEWAY_EDGE, "gateway.api.openai", "gateway.api.llama", "gateway.api.anthropic", "gateway.api.responses",
                    "gateway.api.admin"),  # gateway/api/app.py: the one list of APIs
    "gateway.serve": (*GATEWAY_EDGE, "gateway.api", "worker.shard"),  # the deployment wiring: the replica builds a ShardWorker
    "gateway.launch": (*GATEWAY_EDGE, "gateway.serve"),  # `loraplex serve`: deploys what gateway.serve builds
    "gateway.cli": (*GATEWAY_EDGE, "gateway.api", "gateway.serve", "gateway.launch", "gateway.loadtest"),
}
ALLOWED["bench"] = (*WORKER_BASE, "worker.model", "worker.lora", "worker.engine", "worker.residency", "worker.shard",
                    *(layer for layer in ALLOWED if layer.split(".")[0] == "gateway"))  # drives replicas and gateways
ALLOWED["deploy"] = (*WORKER_BASE, "worker.model", "worker.lora", "worker.engine")  # the example adapters' training, the pods
TORCH_FREE = ("worker.formats", "worker.contract", "cache", "gateway")  # and every layer inside them


def layer_of(module: str) -> str:
    """The most specific layer that `module` belongs to."""
    return max((layer for layer in ALLOWED if module == layer or module.startswith(layer + ".")), key=len)


def our_modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imports_of(path: Path) -> set[str]:
    """Every module of ours that `path` imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(n for n in names if n.split(".")[0] in PACKAGES)
    return found


def upward_imports(modules: dict[str, Path]) -> list[str]:
    found = []
    for module, path in modules.items():
        layer = layer_of(module)
        # `from pkg.mod import name`: the module is pkg.mod
        targets = {
            name if name in modules or name.rpartition(".")[0] not in modules else name.rpartition(".")[0] for name in imports_of(path)
        }
        for imported in sorted(targets):
            target = layer_of(imported)
            if target != layer and target not in ALLOWED[layer] and not layer.startswith(target + "."):
                found.append(f"{module} ({layer}) imports {imported} ({target})")
    return found


def test_every_module_imports_only_its_own_layer_and_the_ones_below() -> None:
    modules = our_modules()
    assert "worker.engine.engine" in modules and "gateway.policy.routing" in modules
    violations = upward_imports(modules)
    assert not violations, "imports that go up a layer:\n" + "\n".join(violations)


def test_the_rule_catches_an_upward_import(tmp_path) -> None:
    modules = our_modules()
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import numpy\nfrom worker.formats.gguf_file import GGUFFile\n\n\ndef f():\n    from worker.engine.engine import Engine\n"
    )
    assert upward_imports({**modules, "worker.formats.bad": bad}) == [
        "worker.formats.bad (worker.formats) imports worker.engine.engine (worker.engine)"
    ]
    assert upward_imports({**modules, "gateway.bad": bad}) == ["gateway.bad (gateway) imports worker.engine.engine (worker.engine)"]
    assert upward_imports({**modules, "bench.bad": bad}) == []
    edge = tmp_path / "edge.py"
    edge.write_text("from gateway.http.incoming import begin\nfrom gateway.errors import GatewayError\n")
    assert upward_imports({**modules, "gateway.tenancy.bad": edge}) == [
        "gateway.tenancy.bad (gateway.tenancy) imports gateway.http.incoming (gateway.http)"
    ]
    assert upward_imports({**modules, "gateway.api.admin.bad": edge}) == []


CODE = """
import importlib, sys
for name in sys.argv[3:]:
    importlib.import_module(name)
from gateway.catalog import Catalog
from gateway.config import load_config
Catalog(load_config())  # the default deployment's model and adapters, as the gateway reads them
from worker.formats.adapter import load_adapter
from worker.formats.fingerprint import base_fingerprint
from worker.formats.gguf_file import GGUFFile
from worker.formats.tokenizer import GGUFTokenizer
base = GGUFFile(sys.argv[2])
load_adapter(sys.argv[1], base), base_fingerprint(base), GGUFTokenizer(base).encode("hello")
from worker.cli.inspect import describe  # `loraplex inspect` stays torch-free too
describe(sys.argv[1], sys.argv[2]), describe(sys.argv[2], None)
assert "torch" not in sys.modules, sorted(m for m in sys.modules if m.startswith("torch"))
print("ok")
"""


def test_torch_free_layers_do_not_load_torch(small_adapter_path, real_model_path) -> None:
    names = [m for m in our_modules() if layer_of(m).startswith(TORCH_FREE)]
    assert "gateway.api.app" in names and "worker.formats.peft_convert" in names and "worker.contract.spec" in names
    done = subprocess.run([sys.executable, "-c", CODE, str(small_adapter_path), str(real_model_path), *names],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


MAX_FUNCTION_LINES = 60


def long_functions(modules: dict[str, Path]) -> list[str]:
    found = []
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES:
                found.append(f"{module}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    return found


def circles(modules: dict[str, Path]) -> list[list[str]]:
    """Modules that import each other, directly or around a loop (Tarjan's strongly connected components)."""
    edges = {m: {i if i in modules else i.rpartition(".")[0] for i in imports_of(p)} & modules.keys() - {m}
             for m, p in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(m: str) -> None:
        index[m] = low[m] = len(index)
        stack.append(m)
        for n in sorted(edges[m]):
            if n not in index:
                visit(n)
                low[m] = min(low[m], low[n])
            elif n in stack:
                low[m] = min(low[m], index[n])
        if low[m] == index[m]:
            component = []
            while (n := stack.pop()) != m:
                component.append(n)
            if component:
                found.append(sorted([m, *component]))

    for m in sorted(modules):
        if m not in index:
            visit(m)
    return found


def test_no_function_in_the_product_runs_over_a_screen(tmp_path) -> None:
    modules = our_modules()
    assert not long_functions(modules), "\n".join(long_functions(modules))
    long = tmp_path / "long.py"
    long.write_text("def f():\n" + "    x = 1\n" * MAX_FUNCTION_LINES)
    assert long_functions({"bench.long": long}) == [f"bench.long.f: {MAX_FUNCTION_LINES + 1} lines"]


def test_no_modules_import_each_other(tmp_path) -> None:
    modules = our_modules()
    assert not circles(modules), circles(modules)
    (tmp_path / "a.py").write_text("from bench.b import f\n")
    (tmp_path / "b.py").write_text("def f():\n    from bench.a import g\n")
    assert circles({**modules, "bench.a": tmp_path / "a.py", "bench.b": tmp_path / "b.py"}) == [["bench.a", "bench.b"]]
