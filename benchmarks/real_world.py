"""Every finding of every rule on the real code bases of `docs/real-world.md`, as JSON.

    python3 benchmarks/real_world.py [--out real-world.json] [--no-gate] [--bed NAME ...]
                                     [--tree NAME=PATH ...] [--corpus DIR [--split tuning|held-out]]
                                     [--jobs N]

Scans each pinned test bed of `tests/testbeds.py` (downloaded on first use) and each `--tree` (a checkout,
e.g. a public upstream main), file by file with every built-in rule, and writes
`{bed: [{path, line, column, rule, message}, ...]}` sorted by path and position. The table in
`docs/real-world.md` is made from this output (the verdicts are a reader's judgement, written by hand); two
runs, one with `--no-gate`, must write identical files (the syntax gate is sound). Files that libcst cannot
parse are listed under `"parse_errors"`.

`--corpus DIR` scans the code bases of `benchmarks/real_world_corpus.json` (the second table: forks, ports
and users of Megatron/TE), each read from `DIR/<owner>+<name>`, a tree of the repository's `*.py` files at
the listed commit (e.g. `git archive <commit> -- '*.py' | tar -x -C DIR/<owner>+<name>`); they are public
upstream repositories, never fetched here or in CI. `--split` keeps only the tuning or the held-out part.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO / "benchmarks" / "real_world_corpus.json"


def corpus_trees(root: Path, split: str | None) -> dict[str, Path]:
    """`{owner/name: DIR/owner+name}` for the corpus entries of `split` (all when None); a clear error for
    a missing tree."""
    entries = json.loads(CORPUS.read_text(encoding="utf-8"))["corpus"]
    trees: dict[str, Path] = {}
    for entry in entries:
        if split is not None and entry["held_out"] != (split == "held-out"):
            continue
        path = root / entry["repo"].replace("/", "+")
        if not path.is_dir():
            raise SystemExit(f"--corpus: no tree for {entry['repo']} at {path} (commit {entry['commit']})")
        trees[entry["repo"]] = path
    return trees


def _testbeds() -> Any:
    spec = importlib.util.spec_from_file_location("maingrad_testbeds", REPO / "tests" / "testbeds.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _scan_file(
    job: tuple[str, str, bool, frozenset[str]],
) -> tuple[str, list[dict[str, Any]], str | None]:
    """Findings of every built-in rule on one file (run in a worker process), under the tree's project
    facts (`maingrad.analyzer.project`), as `maingrad check` on the tree computes them."""
    from maingrad.analyzer.context import RuleSettings
    from maingrad.analyzer.engine import analyze_source
    from maingrad.analyzer.rules import all_rules

    root, rel, gate, project = job
    source = (Path(root) / rel).read_text(encoding="utf-8", errors="replace")
    rules = [rule() for rule in all_rules()]
    result = analyze_source(source, rel, rules, RuleSettings(project=project), gate=gate)
    rows = [
        {"path": rel, "line": f.line, "column": f.column, "rule": f.rule, "message": f.message}
        for f in result.findings
    ]
    error = result.parse_error.message if result.parse_error is not None else None
    return rel, rows, error


def scan_tree(root: Path, gate: bool, jobs: int) -> dict[str, Any]:
    files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py") if p.is_file())
    from maingrad.analyzer.project import ProjectFacts, file_facts

    project = ProjectFacts.of(
        file_facts(rel, (root / rel).read_text(encoding="utf-8", errors="replace")) for rel in files
    ).facts
    work = [(str(root), rel, gate, project) for rel in files]
    findings: list[dict[str, Any]] = []
    errors: list[dict[str, str]] = []
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        for rel, rows, error in pool.map(_scan_file, work, chunksize=16):
            findings.extend(rows)
            if error is not None:
                errors.append({"path": rel, "message": error})
    findings.sort(key=lambda f: (f["path"], f["line"], f["column"], f["rule"]))
    return {"files": len(files), "findings": findings, "parse_errors": errors}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("real-world.json"))
    parser.add_argument("--no-gate", action="store_true", help="turn the syntax gate off")
    parser.add_argument("--bed", action="append", default=[], help="a test bed name (default: all)")
    parser.add_argument("--tree", action="append", default=[], help="NAME=PATH of a checkout to scan too")
    parser.add_argument("--corpus", type=Path, help="DIR holding the trees of real_world_corpus.json")
    parser.add_argument("--split", choices=("tuning", "held-out"), help="only this part of --corpus")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    args = parser.parse_args(argv)
    beds = _testbeds()
    names = args.bed or ([] if args.tree or args.corpus else list(beds.REAL_WORLD))
    unknown = [n for n in names if n not in beds.TESTBEDS]
    if unknown:
        parser.error(f"unknown test bed(s): {', '.join(unknown)}; known: {', '.join(beds.TESTBEDS)}")
    roots: dict[str, Path] = {name: beds.testbed(name) for name in names}
    for item in args.tree:
        name, sep, path = item.partition("=")
        if not sep or not Path(path).is_dir():
            parser.error(f"--tree wants NAME=PATH of a directory, got {item!r}")
        roots[name] = Path(path)
    if args.corpus is not None:
        roots.update(corpus_trees(args.corpus, args.split))
    report: dict[str, Any] = {}
    for name, root in roots.items():
        report[name] = scan_tree(root, gate=not args.no_gate, jobs=args.jobs)
        count = len(report[name]["findings"])
        print(f"{name}: {report[name]['files']} files, {count} findings", file=sys.stderr)
    args.out.write_text(json.dumps(report, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
