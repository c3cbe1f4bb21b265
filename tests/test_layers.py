"""The import-layer rule (README, "Layout"): each package imports only itself and the layers
below it, and the torch-free layers never load torch, not even through what they import."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("worker", "cache", "gateway", "bench")

# layer -> the layers (of ours) it may import besides itself, lowest first
WORKER_BASE = ("worker.formats", "cache", "worker.contract")
ALLOWED: dict[str, tuple[str, ...]] = {
    "worker": (),  # worker/__init__.py: imports nothing
    "worker.formats": (),
    "cache": ("worker.formats",),
    "worker.contract": ("worker.formats", "cache"),
    "worker.model": WORKER_BASE,
    "worker.lora": (*WORKER_BASE, "worker.model"),
    "worker.engine": (*WORKER_BASE, "worker.model", "worker.lora"),
    "worker.shard": (*WORKER_BASE, "worker.model", "worker.lora", "worker.engine"),
    "worker.cli": (*WORKER_BASE, "worker.model", "worker.lora", "worker.engine"),
    "gateway": WORKER_BASE,
    "gateway.serve": (*WORKER_BASE, "gateway", "worker.shard"),  # the deployment wiring: the replica builds a ShardWorker
    "bench": (*WORKER_BASE, "worker.model", "worker.lora", "worker.engine", "worker.shard", "gateway"),  # drives replicas
}
TORCH_FREE = ("worker.formats", "worker.contract", "cache", "gateway")


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
    names = [m for m in our_modules() if layer_of(m) in TORCH_FREE or layer_of(m) == "gateway.serve"]
    assert "gateway.api.app" in names and "worker.formats.peft_convert" in names and "worker.contract.spec" in names
    done = subprocess.run([sys.executable, "-c", CODE, str(small_adapter_path), str(real_model_path), *names],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
