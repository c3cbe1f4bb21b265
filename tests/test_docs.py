"""The docs hold together: every relative link and `#anchor` in README.md and docs/*.md
resolves (the file exists inside the repository; the anchor is a heading's GitHub slug), every
repository path they name exists, and none cites a document outside the repository.
No network: only files are read."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOP_DIRS = ("gateway", "worker", "cache", "bench", "deploy", "tests", "helm", "docker", "docs")

_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$")
_INLINE_CODE = re.compile(r"(`+)(.+?)\1")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REF_DEFINITION = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
_HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")
_REPO_PATH = re.compile(rf"(?<![\w./~-])((?:{'|'.join(TOP_DIRS)})/[\w./-]*)")
_IMPORT_PATH = re.compile(r"^((?:gateway|worker|cache|bench)(?:\.\w+)+):\w+$")
# a numbered section of some document (ours are cited by page and heading), or a path out of the repository
_OUTSIDE = (re.compile(r"§\s*\d"), re.compile(r"\.\./shared"), re.compile(r"/work/shared"))


def doc_files(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def prose_lines(text: str) -> list[tuple[int, str, bool]]:
    """(line number, line, whether it is inside a fenced code block)."""
    lines, in_fence = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            in_fence = not in_fence
            lines.append((number, line, True))
            continue
        lines.append((number, line, in_fence))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: link text kept, markup dropped, lower case, punctuation
    removed (letters, digits, spaces, '-' and '_' kept), each space a '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").lower()
    return "".join(ch for ch in text if ch.isalnum() or ch in " -_").replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor a link into `path` may name: its headings' slugs (repeats numbered -1, -2, ...)
    and explicit HTML anchors."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for _, line, in_code in prose_lines(path.read_text(encoding="utf-8")):
        if in_code:
            continue
        found.update(_HTML_ANCHOR.findall(line))
        match = _HEADING.match(line)
        if match is None:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def link_targets(path: Path) -> list[tuple[int, str]]:
    """(line, target) of every link and image in `path`'s prose (not in code)."""
    targets = []
    for number, line, in_code in prose_lines(path.read_text(encoding="utf-8")):
        if in_code:
            continue
        bare = _INLINE_CODE.sub("", line)
        targets += [(number, target) for target in _LINK.findall(bare)]
        definition = _REF_DEFINITION.match(bare)
        if definition:
            targets.append((number, definition.group(1)))
    return targets


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """Relative links of `path` whose file does not exist in the repository, or whose anchor is no
    heading of the file it names."""
    problems = []
    for number, target in link_targets(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        where = f"{path.relative_to(root)}:{number}: {target}"
        resolved = path if not file_part else ((root / file_part.lstrip("/")) if file_part.startswith("/")
                                               else (path.parent / file_part)).resolve()
        if not resolved.is_relative_to(root):
            problems.append(f"{where} (outside the repository)")
        elif not resolved.exists():
            problems.append(f"{where} (no such file)")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            problems.append(f"{where} (no heading with this anchor in {resolved.relative_to(root)})")
        elif anchor and resolved.suffix != ".md":
            problems.append(f"{where} (an anchor into a file that is not Markdown)")
    return problems


def missing_paths(path: Path, root: Path = ROOT) -> list[str]:
    """Repository paths `path` names (`gateway/...`, `docs/...`, `pkg.module:name`) that do not exist."""
    problems = []
    for number, line, in_code in prose_lines(path.read_text(encoding="utf-8")):
        spans = [m.group(2) for m in _INLINE_CODE.finditer(line)]
        text = line if in_code else _LINK.sub("", line)
        for name in _REPO_PATH.findall(text):
            name = name.rstrip(".")
            if not (root / name).exists():
                problems.append(f"{path.relative_to(root)}:{number}: {name}")
        for span in spans:
            match = _IMPORT_PATH.match(span.strip())
            if match:
                module = root / match.group(1).replace(".", "/")
                if not (module.with_suffix(".py").is_file() or (module / "__init__.py").is_file()):
                    problems.append(f"{path.relative_to(root)}:{number}: {span} (no such module)")
    return problems


def outside_citations(path: Path, root: Path = ROOT) -> list[str]:
    """Lines of `path` that cite a document outside the repository (the design notes it grew from)."""
    return [f"{path.relative_to(root)}:{number}: {line.strip()}"
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
            if any(pattern.search(line) for pattern in _OUTSIDE)]


_CITED = re.compile(r"docs/([\w-]+\.md)(?:#([\w-]+))?")
CODE_DIRS = ("gateway", "worker", "cache", "bench", "deploy", "helm", "docker", "tests")
CODE_SUFFIXES = {".py", ".yaml", ".yml", ".tpl", ".json", ".md", ".toml", ".txt", ""}


def unresolved_citations(root: Path = ROOT) -> list[str]:
    """`docs/PAGE.md#anchor` references in the code and its files whose page or anchor does not exist."""
    problems = []
    files = [path for name in CODE_DIRS for path in sorted((root / name).rglob("*"))
             if path.is_file() and path.suffix in CODE_SUFFIXES and path.name != "test_docs.py"]
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        for number, line in enumerate(text.splitlines(), 1):
            for page, anchor in _CITED.findall(line):
                target = root / "docs" / page
                if not target.is_file():
                    problems.append(f"{path.relative_to(root)}:{number}: docs/{page} (no such page)")
                elif anchor and anchor not in anchors(target):
                    problems.append(f"{path.relative_to(root)}:{number}: docs/{page}#{anchor} (no such heading)")
    return problems


def test_docs_exist() -> None:
    names = {p.name for p in doc_files()}
    assert {"README.md", "architecture.md", "quickstart.md", "benchmarks.md"} <= names
    assert (ROOT / "docs" / "loadtest-zipf-cache-hit.png").is_file()


def test_every_link_and_anchor_resolves() -> None:
    problems = [problem for path in doc_files() for problem in broken_links(path)]
    assert not problems, "links that do not resolve:\n" + "\n".join(problems)


def test_every_repository_path_named_exists() -> None:
    problems = [problem for path in doc_files() for problem in missing_paths(path)]
    assert not problems, "paths the docs name that are not in the tree:\n" + "\n".join(problems)


def test_every_docs_reference_in_the_code_resolves() -> None:
    problems = unresolved_citations()
    assert not problems, "code that cites a docs page or anchor that is not there:\n" + "\n".join(problems)


def test_no_doc_cites_what_is_outside_the_repository() -> None:
    problems = [problem for path in doc_files() for problem in outside_citations(path)]
    assert not problems, "citations of documents outside the repository:\n" + "\n".join(problems)


def test_the_image_is_linked() -> None:
    linked = {target for path in doc_files() for _, target in link_targets(path)}
    assert any(target.endswith("loadtest-zipf-cache-hit.png") for target in linked)


def test_the_checks_catch_what_is_wrong(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "gateway").mkdir()
    (tmp_path / "gateway" / "config.py").write_text("")
    page = tmp_path / "docs" / "page.md"
    page.write_text("# A page: `its` title\n\n## Worker call\n\n## Worker call\n")
    readme = tmp_path / "README.md"
    readme.write_text(
        "# Title\n\n"
        "[ok](docs/page.md#worker-call) [ok too](docs/page.md#worker-call-1) [top](docs/page.md#a-page-its-title)\n"
        "[self](#title) [web](https://example.com/x) `[not a link](nowhere.md)`\n"
        "[gone](docs/missing.md) [bad anchor](docs/page.md#worker-calls) [up](../shared/x.md)\n"
        "```\n[in code](nowhere.md)\n# not a heading\n```\n"
        "See `gateway/config.py`, `gateway/gone.py` and `gateway.config:load`, `gateway.nope:x`.\n"
        "As the design says in §2.\n")
    (tmp_path / "gateway" / "cited.py").write_text("# see docs/page.md#worker-call and docs/page.md#nope, docs/gone.md\n")
    assert unresolved_citations(tmp_path) == ["gateway/cited.py:1: docs/page.md#nope (no such heading)",
                                              "gateway/cited.py:1: docs/gone.md (no such page)"]
    assert slug("Placement: `loraplex plan`") == "placement-loraplex-plan"
    assert slug("Quotas: overshoot 0") == "quotas-overshoot-0"
    assert anchors(page) == {"a-page-its-title", "worker-call", "worker-call-1"}
    assert broken_links(readme, tmp_path) == [
        "README.md:5: docs/missing.md (no such file)",
        "README.md:5: docs/page.md#worker-calls (no heading with this anchor in docs/page.md)",
        "README.md:5: ../shared/x.md (outside the repository)",
    ]
    assert missing_paths(readme, tmp_path) == ["README.md:10: gateway/gone.py", "README.md:10: gateway.nope:x (no such module)"]
    assert outside_citations(readme, tmp_path) == ["README.md:5: [gone](docs/missing.md) [bad anchor](docs/page.md#worker-calls) "
                                                   "[up](../shared/x.md)", "README.md:11: As the design says in §2."]
