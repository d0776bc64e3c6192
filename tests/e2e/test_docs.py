"""The documentation: README.md is the front page (short, its links good), docs/ the site,
one page a topic, built by MkDocs in strict mode so that a missing page, a page left out of
the navigation or a broken link or anchor between pages fails here."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from support import ROOT

DOCS = ROOT / "docs"
README_MAX_LINES = 250


def build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                           "--config-file", str(config), "--site-dir", str(site)],
                          capture_output=True, text=True, timeout=120)


def nav_pages() -> list[str]:
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    return [page for entry in nav for page in entry.values()]


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    result = build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "site" / "index.html").exists()


def test_a_broken_link_between_pages_fails_the_build(tmp_path: Path) -> None:
    """The check above proves something: strict mode fails on a missing page and on a
    missing section of a page that exists."""
    shutil.copy(ROOT / "mkdocs.yml", tmp_path)
    for broken, named in [("[gone](no-such-page.md)", "no-such-page.md"),
                          ("[gone](canary.md#no-such-section)", "#no-such-section")]:
        shutil.rmtree(tmp_path / "docs", ignore_errors=True)
        shutil.copytree(DOCS, tmp_path / "docs")
        page = tmp_path / "docs" / "routing.md"
        page.write_text(page.read_text() + f"\nSee {broken}.\n")
        result = build(tmp_path / "mkdocs.yml", tmp_path / "site")
        assert result.returncode != 0 and named in result.stderr, result.stderr


def test_every_page_is_in_the_navigation_and_every_listed_page_exists() -> None:
    listed = nav_pages()
    assert len(listed) == len(set(listed))
    assert sorted(listed) == sorted(p.name for p in DOCS.glob("*.md"))


def test_the_readme_is_a_front_page() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= README_MAX_LINES
    assert "make demo" in readme and "make test" in readme
    assert "GATEWAY_SKIP_REAL_ENGINES" in readme
    # Its map of the docs names every page, and every link it has leads somewhere.
    links = re.findall(r"\]\(([^)]+)\)", readme)
    targets = {link.split("#")[0] for link in links if "://" not in link}
    assert {f"docs/{page}" for page in nav_pages()} <= targets
    for link in links:
        if "://" in link:
            continue
        path, _, anchor = link.partition("#")
        assert (ROOT / path).exists(), link
        if anchor:
            headings = re.findall(r"^#+ (.+)$", (ROOT / path).read_text(), re.M)
            assert anchor in {slug(h) for h in headings}, link


def slug(heading: str) -> str:
    """The anchor Python-Markdown's toc extension gives a heading (its default slugify)."""
    text = re.sub(r"[^\w\s-]", "", heading.replace("`", "")).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def test_the_performance_page_is_todays_figures_and_their_commands() -> None:
    """Today's figures, each beside the command that made it, in under 250 lines; the
    run-by-run history is the results log beside the benchmarks."""
    page = (DOCS / "performance.md").read_text()
    assert len(page.splitlines()) < 250
    assert "`benchmarks/RESULTS.md`" in page and (ROOT / "benchmarks" / "RESULTS.md").exists()
    sections = re.split(r"\n## ", page)[1:]
    for section in sections:  # every section of figures names how to reproduce them
        title = section.splitlines()[0]
        if title != "Sizing a deployment":  # arithmetic on the sections below
            assert "python -m benchmarks." in section or "llm-gateway bench" in section, title


def test_every_page_opens_with_what_its_reader_wants_to_do() -> None:
    for page in nav_pages():
        opening = (DOCS / page).read_text().split("\n\n")[1]  # the paragraph under the title
        assert re.match(r"(You want|To \w+) ", opening), (page, opening[:120])
