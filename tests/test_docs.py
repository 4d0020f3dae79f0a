"""README and docs/ hold together: every relative link names a file of the checkout, and every #anchor a heading of
the page it points to (GitHub's slugs); every page of docs/ is linked from README."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (hyphens and underscores kept), spaces to
    hyphens."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    headings, fence = [], False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and (m := re.match(r"#{1,6} (.+)", line)):
            headings.append(slug(m.group(1)))
    return set(headings)


def links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code blocks hold no links
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]


def test_every_relative_link_resolves():
    broken = []
    for page in PAGES:
        for target in links(page):
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)
    assert sum(len(links(p)) for p in PAGES) > 20  # the check saw the links


def test_every_docs_page_is_linked_from_readme():
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in links(ROOT / "README.md")}
    assert set(PAGES[1:]) <= linked, sorted(str(p) for p in set(PAGES[1:]) - linked)


def test_slugs_are_githubs():
    assert slug("Multi-host (one model over several hosts)") == "multi-host-one-model-over-several-hosts"
    assert slug("The step compiled for an H100, without a GPU (`benchmarks/gpu_hlo_report.py`)") == \
        "the-step-compiled-for-an-h100-without-a-gpu-benchmarksgpu_hlo_reportpy"
