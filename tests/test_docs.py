"""The README and docs/: the README stays a ten-minute guide, every relative link resolves, and
no page refers to the project's issue or stop numbers. No TensorFlow needed."""
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README] + sorted((ROOT / "docs").glob("*.md"))
STRATEGIES = ("hybrid", "ps", "allreduce", "auto", "slim_dp", "ps_plus", "stanza", "dsp")

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")


def prose_lines(path):
    """(line number, text) of the lines outside fenced code blocks."""
    inside = False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line):
            inside = not inside
            continue
        if not inside:
            yield number, line


def links(path):
    """(line number, target) of every markdown link outside code blocks and inline code."""
    for number, line in prose_lines(path):
        for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
            yield number, target


def headings(path):
    return [(len(m.group(1)), m.group(2)) for _, line in prose_lines(path) if (m := HEADING.match(line))]


def slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.replace("`", "").lower())
    return text.replace(" ", "-")


def anchors(path):
    seen, found = {}, set()
    for _, text in headings(path):
        base = slug(text)
        count = seen.get(base, 0)
        found.add(base if count == 0 else f"{base}-{count}")
        seen[base] = count + 1
    return found


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 350, f"README.md has {len(lines)} lines; move detail to docs/"


def test_pages_exist():
    names = {p.name for p in PAGES}
    assert {"README.md", "strategies.md", "benchmarks.md", "design.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    checked, broken = 0, []
    for number, target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
            continue                                  # http(s), mailto: and in-page anchors
        file_part, _, anchor = target.partition("#")
        resolved = (page.parent / file_part).resolve()
        checked += 1
        if not resolved.exists():
            broken.append(f"{page.name}:{number}: {target}")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{page.name}:{number}: {target} (no heading with that anchor)")
    assert not broken, "broken links:\n" + "\n".join(broken)
    if page == README:
        assert checked >= 4       # docs/strategies.md, docs/benchmarks.md, docs/design.md, BUILD.md


def test_slug_matches_github():
    assert slug("`slim_dp`: synchronise only the significant parameters (Slim-DP)") == \
        "slim_dp-synchronise-only-the-significant-parameters-slim-dp"
    assert slug("Where a rank's CPU goes") == "where-a-ranks-cpu-goes"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_issue_or_stop_numbers(page):
    pattern = re.compile(r"\b(issue|stop) #?\d+", re.IGNORECASE)
    hits = [f"{page.name}:{n}: {line.strip()}"
            for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1) if pattern.search(line)]
    assert not hits, "write these as plain statements:\n" + "\n".join(hits)


def test_readme_names_the_essentials():
    text = README.read_text(encoding="utf-8")
    for needed in ("make demo", "make test", "python -m parallax_tf check", "parallax_tf: error:"):
        assert needed in text, needed


def test_readme_sections_in_order():
    titles = [text for level, text in headings(README) if level == 2]
    wanted = ["Quick start", "Using it", "Choosing a strategy", "Strategies", "Checkpoints and faults",
              "Network exposure", "Troubleshooting", "More"]
    positions = [next((i for i, t in enumerate(titles) if t.lower().startswith(w.lower())), None) for w in wanted]
    assert None not in positions, f"missing among {titles}"
    assert positions == sorted(positions), titles


def test_troubleshooting_starts_with_check():
    text = README.read_text(encoding="utf-8")
    section = text.split("## Troubleshooting", 1)[1].split("\n## ", 1)[0]
    first = next(line for line in section.splitlines() if line.strip() and not line.startswith("Start"))
    assert "python -m parallax_tf check" in first


def test_readme_has_a_heading_per_strategy():
    names = []
    for level, text in headings(README):
        word = re.sub(r"[`*]", "", text).strip().split()[0].rstrip(":") if text.strip() else ""
        names.append(word)
    missing = [s for s in STRATEGIES if s not in names]
    assert not missing, f"no heading for {missing}"
    under = README.read_text(encoding="utf-8").split("\n## Strategies", 1)[1].split("\n## ", 1)[0]
    for strategy in STRATEGIES:
        body = re.split(r"\n### ", under)
        section = next(b for b in body if re.sub(r"[`*]", "", b).split()[0].rstrip(":") == strategy)
        assert len(section.strip().splitlines()) <= 21, f"{strategy}: more than 20 lines in the README"


def test_docs_pages_have_each_strategy():
    text = (ROOT / "docs" / "strategies.md").read_text(encoding="utf-8")
    for strategy in STRATEGIES:
        assert re.search(rf"^##.*\b{re.escape(strategy)}\b", text, re.MULTILINE), strategy


def test_choosing_a_strategy_covers_fast_links_cnns_and_unseen_clusters():
    text = README.read_text(encoding="utf-8")
    section = text.split("## Choosing a strategy", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "`" in line]
    auto = next(row for row in rows if "| `auto` |" in row)
    assert "fast link" in auto and "--link_bandwidth" in auto
    assert any("CNN" in row and "dense gradients only" in row for row in rows)
    assert "python -m\ntools.simulate" in section or "python -m tools.simulate" in section
