"""The names other files give our code resolve: the chart's Ray Serve import path and the console
scripts pyproject.toml installs. A module moved without its name moving too fails here, not in a
cluster."""

from __future__ import annotations

import importlib
import tomllib

import yaml

from tests.deploy.test_helm import ROOT, render


def resolve(import_path: str) -> object:
    module, _, name = import_path.replace(":", ".").rpartition(".")
    return getattr(importlib.import_module(module), name)


def test_the_rendered_charts_serve_import_path_imports() -> None:
    services = [doc for doc in render() if doc["kind"] == "RayService"]
    apps = [app for s in services for app in yaml.safe_load(s["spec"]["serveConfigV2"])["applications"]]
    assert apps and all(callable(resolve(app["import_path"])) for app in apps)


def test_every_console_script_imports() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts and all(callable(resolve(target)) for target in scripts.values())
