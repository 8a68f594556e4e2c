"""The README's figures are BENCHMARKS.md's: a figure edited in one and not the other fails here.

The README cites a measured figure as a link to its row of BENCHMARKS.md's table of current
figures, `[8 min 10 s](BENCHMARKS.md#demo-time)`, and each row opens with `<a id="KEY"></a>`. A
cited figure must appear whole in its row's goal or latest cell. Figures of the kinds the table
holds (test counts, durations in min and s, signed reward gains, "N of M runs") may not appear in
the README outside such a link, so a new figure cannot skip the check by not linking. The
checker is plain functions over the two texts, so the tests below also run it on edited copies.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CITATION = re.compile(r"\[([^\]]+)\]\(BENCHMARKS\.md#([\w-]+)\)")
ROW_KEY = re.compile(r'<a id="([\w-]+)"></a>')
# the kinds of figure the table holds; one of these in the README must be a citation
UNCITED_FIGURE = re.compile(
    r"\b\d[\d,]* tests\b"
    r"|\b\d+ min \d+ s\b"
    r"|(?<![\w.])[+-]\d+\.\d+"
    r"|\b\d+ of \d+ runs\b"
)
# the figures the README's first screen and test section must cite, so deleting a link fails too
REQUIRED = {"demo-time", "demo-gain", "test-full", "test-unit", "test-fast"}
COLUMNS = 5  # goal | latest | measured | command | status


def table_rows(benchmarks: str) -> dict[str, list[str]]:
    """KEY -> the row's cells, for every row of the current-figures tables."""
    rows: dict[str, list[str]] = {}
    for line in benchmarks.splitlines():
        key = ROW_KEY.search(line)
        if not line.startswith("|") or key is None:
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        assert len(cells) == COLUMNS, f"row {key.group(1)} has {len(cells)} cells: {line}"
        assert key.group(1) not in rows, f"row {key.group(1)} appears twice"
        rows[key.group(1)] = cells
    return rows


def appears_whole(figure: str, text: str) -> bool:
    """`figure` is in `text`, not as part of a longer number ("8 min" is not in "18 min")."""
    return re.search(rf"(?<![\w.]){re.escape(figure)}(?![\w.])", text) is not None


def problems(readme: str, benchmarks: str) -> list[str]:
    """Every way the README disagrees with BENCHMARKS.md's table; empty when they agree."""
    rows = table_rows(benchmarks)
    found = []
    cited = set()
    for figure, key in CITATION.findall(readme):
        cited.add(key)
        if key not in rows:
            found.append(f"README cites row {key!r}, which BENCHMARKS.md does not have")
        elif any(ch.isdigit() for ch in figure) and not appears_whole(figure, rows[key][0] + " | " + rows[key][1]):
            found.append(f"README says {figure!r} for {key!r}; BENCHMARKS.md's row says: {rows[key][1]}")
    for figure in UNCITED_FIGURE.findall(CITATION.sub("", readme)):
        found.append(f"README has the figure {figure!r} without a link to its BENCHMARKS.md row")
    found += [f"README does not cite row {key!r}" for key in sorted(REQUIRED - cited)]
    return found


def first_screen(readme: str) -> str:
    """From the top to the first `##` heading after the two commands."""
    after_commands = readme.index("just test")
    return readme[: readme.index("\n## ", after_commands)]


@pytest.fixture(scope="module")
def readme() -> str:
    return (ROOT / "README.md").read_text()


@pytest.fixture(scope="module")
def benchmarks() -> str:
    return (ROOT / "BENCHMARKS.md").read_text()


def test_every_figure_the_readme_cites_is_the_one_in_benchmarks(readme, benchmarks):
    assert problems(readme, benchmarks) == []


def test_every_row_has_a_status_and_a_missed_goal_says_by_how_much(benchmarks):
    rows = table_rows(benchmarks)
    assert REQUIRED <= rows.keys()
    for key, (goal, latest, measured, command, status) in rows.items():
        assert goal and latest and measured and command and status, key
        if "missed" in status:
            assert "missed by" in status, f"{key}: a missed goal says by how much: {status}"


def _bump_first_digit(figure: str) -> str:
    i = next(i for i, ch in enumerate(figure) if ch.isdigit())
    return figure[:i] + str((int(figure[i]) + 1) % 10) + figure[i + 1:]


def test_any_cited_figure_edited_in_the_readme_is_reported(readme, benchmarks):
    """Each citation in turn, one digit changed in memory: the checker names that figure."""
    citations = [m for m in CITATION.finditer(readme) if any(ch.isdigit() for ch in m.group(1))]
    assert len(citations) >= 6
    for m in citations:
        edited = _bump_first_digit(m.group(1))
        text = readme[: m.start(1)] + edited + readme[m.end(1):]
        assert any(repr(edited) in p for p in problems(text, benchmarks)), (m.group(0), edited)


def test_an_edited_figure_in_benchmarks_is_reported_too(readme, benchmarks):
    # the suite's time, which the README cites: one more minute in BENCHMARKS.md must be caught
    m = re.search(r"tests passed in (\d+) min (\d+) s of pytest", benchmarks)
    assert m, "test-full's row no longer says 'N tests passed in M min S s of pytest'"
    changed = benchmarks[:m.start(1)] + str(int(m.group(1)) + 1) + benchmarks[m.end(1):]
    assert any(f"'{m.group(1)} min {m.group(2)} s'" in p and "test-full" in p for p in problems(readme, changed))


def test_a_figure_outside_a_citation_is_reported(readme, benchmarks):
    text = readme.replace("## Contents", "The suite has 900 tests and gains +0.21.\n\n## Contents", 1)
    found = problems(text, benchmarks)
    assert any("'900 tests'" in p for p in found) and any("'+0.21'" in p for p in found)


def test_a_citation_of_a_missing_row_or_a_dropped_citation_is_reported(readme, benchmarks):
    renamed = readme.replace("BENCHMARKS.md#demo-time", "BENCHMARKS.md#demo-duration")
    found = problems(renamed, benchmarks)
    assert any("'demo-duration'" in p for p in found)
    assert any("does not cite row 'demo-time'" in p for p in found)


def test_the_readme_opens_with_the_two_commands_and_a_short_first_screen(readme):
    assert readme.startswith(
        "# SeamlessFlow\n\n```bash\nbash scripts/bootstrap.sh && .venv/bin/just demo\n```\n"
        "```bash\nbash scripts/bootstrap.sh && .venv/bin/just test\n```\n"
    )
    words = len(first_screen(readme).split())
    assert words < 200, f"the README's first screen is {words} words"
