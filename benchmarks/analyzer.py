"""Speed of `maingrad check` on megatron-core 0.19.2 against baselines measured in the same run.

    python3 benchmarks/analyzer.py [--testbed megatron-core-0.19.2] [--jobs N] [--skip-fixit]

Measures, each in a fresh process (interpreter start-up included, as a user sees it), best of `--repeat`
interleaved runs (the machine is shared; the minimum is the least disturbed run):
- maingrad check, cold (empty cache) and warm (second run on the same cache);
- `ruff check --select F401 --no-cache` (a native linter's floor for touching every file);
- the floor: read every file, apply the same text pre-filter as maingrad (the selected rules' needles) and
  `libcst.parse_module` every file that passes, with the same number of worker processes. maingrad
  itself goes one step further: its syntax gate (`maingrad.analyzer.syntax_index`, one stdlib `ast.parse`
  per text-filtered file) keeps it from libcst-parsing the files no rule can report on, so it may beat
  the floor;
- Fixit 2 with a one-visitor rule (a trivial `visit_Attribute`), written to a temporary directory.

Targets (issue 2, acceptance 6): cold <= 1.5x the floor, warm <= 0.25 s, Fixit >= 20x slower than cold.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

FIXIT_RULE = '''
import libcst as cst
from fixit import LintRule


class MainGradAttribute(LintRule):
    """One visitor: report every `X.main_grad` attribute."""

    def visit_Attribute(self, node: cst.Attribute) -> None:
        if node.attr.value == "main_grad":
            self.report(node, "main_grad attribute")
'''


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


_CPU: dict[tuple[str, ...], float] = {}  # command -> CPU seconds of its last run (process tree)


def _time(cmd: list[str], cwd: Path | None = None, env: dict[str, str] | None = None) -> tuple[float, str]:
    """Wall seconds and stdout of one run; its CPU seconds (user + system, worker processes included) are
    kept in _CPU: on a shared machine CPU time is far less disturbed by other load than wall time."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    elapsed = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    _CPU[tuple(cmd)] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if done.returncode not in (0, 1):
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stderr[-2000:]}")
    return elapsed, done.stdout


def floor(directory: Path, jobs: int) -> None:
    """The floor script (run in its own process): read, pre-filter, parse what passes."""
    import multiprocessing

    from maingrad.analyzer.catalog import load_rules_metadata
    from maingrad.analyzer.needles import needles_match

    needles = tuple({n for rule in load_rules_metadata() for n in rule.needles})
    texts = []
    for path in sorted(directory.rglob("*.py")):
        text = path.read_bytes().decode("utf-8", errors="replace")
        if needles_match(needles, text):
            texts.append(text)
    texts.sort(key=len, reverse=True)
    if jobs > 1 and len(texts) > 1:
        context = multiprocessing.get_context("fork") if sys.platform.startswith("linux") else None
        with (context or multiprocessing).Pool(min(jobs, len(texts))) as pool:
            parsed = sum(pool.imap_unordered(_parse, texts, chunksize=1))
    else:
        parsed = sum(map(_parse, texts))
    print(f"floor parsed {parsed} text-filtered files")


def _parse(text: str) -> int:
    import libcst

    try:
        libcst.parse_module(text)
    except Exception:
        return 0
    return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--testbed", default="megatron-core-0.19.2")
    parser.add_argument("--path", type=Path, help="scan this directory instead of a test bed")
    parser.add_argument("--jobs", type=int, default=_cpu_count())
    parser.add_argument("--skip-fixit", action="store_true")
    parser.add_argument(
        "--repeat", type=int, default=3, help="runs per measurement (best is kept); Fixit runs once"
    )
    parser.add_argument("--floor", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.floor is not None:
        floor(args.floor, args.jobs)
        return 0

    if args.path is not None:
        source = args.path.resolve()
    else:
        from testbeds import testbed

        source = testbed(args.testbed)
    files = sorted(source.rglob("*.py"))
    lines = sum(p.read_bytes().count(b"\n") for p in files)
    print(
        f"test bed: {source} ({len(files)} files, {lines} lines), jobs={args.jobs}, python {sys.version.split()[0]}"
    )

    results: dict[str, float] = {}
    results_cpu: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="maingrad-bench-") as tmp:
        tree = Path(tmp) / "tree"
        shutil.copytree(source, tree)  # a private copy: the cache goes into it, the test bed stays clean
        maingrad = [
            sys.executable,
            "-m",
            "maingrad.cli",
            "check",
            "--quiet",
            "--no-progress",
            f"--jobs={args.jobs}",
        ]
        from ruff.__main__ import find_ruff_bin

        ruff = [find_ruff_bin(), "check", "--select", "F401", "--no-cache", "--isolated", "."]
        floor_cmd = [sys.executable, __file__, "--floor", str(tree), "--jobs", str(args.jobs)]
        _time([*maingrad, "--no-cache", "."], cwd=tree)  # warm the OS file cache and .pyc files for everyone
        samples: dict[str, list[float]] = {}
        cpu: dict[str, list[float]] = {}
        out = floor_out = ""
        from maingrad.analyzer.catalog import source_hash

        done = attempts = 0
        while done < max(1, args.repeat):  # interleaved, so load changes hit every measurement alike
            attempts += 1
            before = source_hash.__wrapped__()
            shutil.rmtree(tree / ".maingrad_cache", ignore_errors=True)
            cold, out = _time([*maingrad, "."], cwd=tree)
            cold_cpu = _CPU[tuple([*maingrad, "."])]
            warm, warm_out = _time([*maingrad, "."], cwd=tree)
            if source_hash.__wrapped__() != before and attempts < 10:
                continue  # the analyzer's sources changed mid-pair (a shared work tree): the warm run missed
            if out != warm_out:
                raise RuntimeError("warm output differs from cold output")
            samples.setdefault("maingrad cold", []).append(cold)
            samples.setdefault("maingrad warm", []).append(warm)
            cpu.setdefault("maingrad cold", []).append(cold_cpu)
            cpu.setdefault("maingrad warm", []).append(_CPU[tuple([*maingrad, "."])])
            done += 1
            samples.setdefault("ruff F401", []).append(_time(ruff, cwd=tree)[0])
            cpu.setdefault("ruff F401", []).append(_CPU[tuple(ruff)])
            elapsed, floor_out = _time(floor_cmd)
            if "floor parsed" not in floor_out:  # exit 1 is a finding for maingrad, a crash for the floor
                raise RuntimeError(f"the floor script failed: {' '.join(floor_cmd)}")
            samples.setdefault("floor", []).append(elapsed)
            cpu.setdefault("floor", []).append(_CPU[tuple(floor_cmd)])
        for name, values in samples.items():
            results[name] = min(values)
            results_cpu[name] = min(cpu[name])
            print(f"{name:<16} runs: {', '.join(f'{v:.3f}' for v in values)}")
        _, report = _time([*maingrad, "--no-cache", "--format", "json", "."], cwd=tree)
        gated = json.loads(report)["files_parsed"]
        print(
            f"findings: {len(out.splitlines())}; {floor_out.strip()} (text pre-filter only); maingrad "
            f"libcst-parsed {gated} after its syntax gate"
        )

        if not args.skip_fixit:
            rules = Path(tmp) / "rules"
            rules.mkdir()
            (rules / "bench_fixit_rule.py").write_text(textwrap.dedent(FIXIT_RULE), encoding="utf-8")
            env = {**os.environ, "PYTHONPATH": f"{rules}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
            fixit = [sys.executable, "-m", "fixit", "--rules", "bench_fixit_rule", "lint", "."]
            results["fixit (1 rule)"], _ = _time(fixit, cwd=tree, env=env)
            results_cpu["fixit (1 rule)"] = _CPU[tuple(fixit)]

    print()
    print(f"{'run':<22}{'wall s':>10}{'cpu s':>10}")
    for name, seconds in results.items():
        print(f"{name:<22}{seconds:>10.3f}{results_cpu.get(name, float('nan')):>10.3f}")
    print()
    cold, warm, base = results["maingrad cold"], results["maingrad warm"], results["floor"]
    cpu_ratio = results_cpu["maingrad cold"] / results_cpu["floor"]
    print(f"cold / floor      = {cold / base:6.2f}   (target <= 1.5; CPU time ratio {cpu_ratio:.2f})")
    print(f"warm              = {warm:6.3f} s (target <= 0.25 s)")
    print(f"cold / ruff F401  = {cold / results['ruff F401']:6.1f}")
    if "fixit (1 rule)" in results:
        print(f"fixit / cold      = {results['fixit (1 rule)'] / cold:6.1f}   (target >= 20)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
