"""One Ray everywhere: the version pyproject.toml pins (what the images install, and this
environment), the chart's `ray.version` (what KubeRay configures the head and workers for) and the
rendered RayService's `rayVersion`. Head and workers of different Ray builds can disagree."""

from __future__ import annotations

import importlib.metadata
import re
import tomllib

import yaml

from tests.deploy.test_helm import CHART, ROOT, render


def pinned_ray() -> str:
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = [m.group(1) for d in dependencies if (m := re.fullmatch(r"ray(?:\[[\w,]+\])?==([\w.]+)", d.replace(" ", "")))]
    assert len(pins) == 1, f"ray must be pinned exactly once in pyproject.toml: {dependencies}"
    return pins[0]


def test_the_chart_and_the_image_name_one_ray() -> None:
    pinned = pinned_ray()
    assert yaml.safe_load((CHART / "values.yaml").read_text())["ray"]["version"] == pinned
    services = [doc for doc in render() if doc["kind"] == "RayService"]
    assert services and all(s["spec"]["rayClusterConfig"]["rayVersion"] == pinned for s in services)
    assert importlib.metadata.version("ray") == pinned  # what this environment (and CI) installed from the pin
