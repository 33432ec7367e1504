"""`maingrad fix` is linear in the number of fixes: time and peak RSS against `check` on the same file.

    python3 benchmarks/fix.py [--sizes 1000,2000,4000,8000,16000,41000] [--repeat 1]

Each size is a generated module of backward functions with three fixable findings each (MG003 x2, MG009;
two of them unsafe, so `fix --unsafe-fixes` is run), no two fixes on one node (so one round fixes all). For every size, in fresh processes
(interpreter start-up included) and one run of this script (a shared machine: only ratios within the run
mean anything):
- `maingrad check --no-cache F` (the reference);
- `maingrad fix --unsafe-fixes --no-cache` on a copy of F: it fixes, writes, and then checks the fixed file
  to report what is left, so it does at least the work of one `check` plus the fixing.
Printed: seconds and peak RSS of both, fix/check ratios, fix seconds per 1k fixes (flat when linear), and
the findings left after the fix (must be 0: every generated finding has a fix).

Targets: at 41k fixes, fix <= 2x check in time and in peak RSS; per-1k-fix time of the largest
size within 2x of the smallest's.

Measured (`--sizes 1000,4000,16000,41000`, one run on the shared 2-core development machine, 2026-12-04):

| fixes | check s | check MB | fix s | fix MB | fix/check time | fix/check memory | fix s per 1k fixes |
|---:|---:|---:|---:|---:|---:|---:|---:|
| 1,000 | 4.67 | 107 | 7.18 | 113 | 1.54 | 1.06 | 7.18 |
| 4,000 | 58.35 | 329 | 160.70 | 383 | 2.75 | 1.17 | 40.18 |
| 16,000 | 114.81 | 227 | 177.25 | 185 | 1.54 | 0.82 | 11.08 |
| 41,000 | 346.97 | 334 | 469.82 | 206 | 1.35 | 0.62 | 11.46 |

At 41k all three targets hold (1.35x time, 0.62x memory, 1.60x the 1k per-fix time, which includes start-up;
16k to 41k: 11.08 to 11.46 s per 1k fixes). Every finding was fixed (0 left). The 4k row is the one file below
the 1 MB segmentation threshold that is large: analysed whole, `check` itself was superlinear there (MG002's
gate and MG008's flag scan went over the whole module per write / per backward), and `fix` paid that twice
(its round and the check of what is left). With both collected once per file (`--sizes 1000,4000`, same
machine, later): 1k check 1.32 s / fix 2.12 s (1.61x), 4k check 4.20 s / fix 8.48 s (2.02x, 1.17x memory),
2.12 s per 1k fixes at both sizes. Before the splicing fixer (same kind of file):
1k/2k/4k/8k fixes took 2.7/6.4/14.7/39.1 s, and 41k fixes 1,112 s and 2.45 GB against `check`'s 50 s and
276 MB: one whole-module libcst transform and code generation per round, every file parsed whole, and a
second full round to confirm.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FIXES_PER_FUNCTION = 3
_FUNCTION = """def backward_{i}(ctx, dy):
    weight = ctx.weight
    if hasattr(weight, "__fsdp_param__"):
        weight.main_grad = weight.get_main_grad()
    if weight.main_grad:
        general_gemm(ctx.x, dy, out=weight.main_grad, layout="NT")
        if hasattr(weight, "grad_added_to_main_grad"):
            weight.grad_added_to_main_grad = True
    return weight.main_grad or dy


"""


def fixable_file(fixes: int) -> str:
    return "".join(_FUNCTION.format(i=i) for i in range(fixes // FIXES_PER_FUNCTION))


def _run(args: list[str], cwd: Path) -> tuple[float, float, str]:
    """Run `maingrad <args>` in a child process; (wall seconds, its peak RSS in MB, stdout)."""
    cmd = [sys.executable, "-m", "maingrad.cli", *args]
    start = time.perf_counter()
    process = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert process.stdout is not None
    out = process.stdout.read()
    _, status, usage = os.wait4(process.pid, 0)
    elapsed = time.perf_counter() - start
    code = os.waitstatus_to_exitcode(status)
    if code not in (0, 1):
        raise RuntimeError(f"{' '.join(cmd)} exited {code}")
    return elapsed, usage.ru_maxrss / 1024, out.decode()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="1000,2000,4000,8000,16000,41000")
    parser.add_argument("--repeat", type=int, default=1, help="best of N interleaved runs per size")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = []
    ok = True
    with tempfile.TemporaryDirectory(prefix="maingrad-fix-bench-") as tmp:
        root = Path(tmp)
        for size in sizes:
            (root / "f.py").write_text(fixable_file(size), encoding="utf-8")
            best_check: tuple[float, float] | None = None
            best_fix: tuple[float, float] | None = None
            left = -1
            found = -1
            for _ in range(args.repeat):
                seconds, rss, out = _run(
                    ["check", "--no-cache", "--no-progress", "--format", "json", "f.py"], root
                )
                found = len(json.loads(out)["findings"])
                best_check = (
                    (seconds, rss)
                    if best_check is None
                    else (min(best_check[0], seconds), min(best_check[1], rss))
                )
                shutil.copy(root / "f.py", root / "g.py")
                seconds, rss, _ = _run(["fix", "--unsafe-fixes", "--no-cache", "--no-progress", "g.py"], root)
                best_fix = (
                    (seconds, rss) if best_fix is None else (min(best_fix[0], seconds), min(best_fix[1], rss))
                )
                _, _, out = _run(["check", "--no-cache", "--no-progress", "--format", "json", "g.py"], root)
                left = len(json.loads(out)["findings"])
            assert best_check is not None and best_fix is not None
            rows.append((size, found, left, best_check, best_fix))
            print(
                f"{size:>6} fixes ({found} findings): check {best_check[0]:7.2f} s {best_check[1]:6.0f} MB | "
                f"fix {best_fix[0]:7.2f} s {best_fix[1]:6.0f} MB | time x{best_fix[0] / best_check[0]:.2f} "
                f"memory x{best_fix[1] / best_check[1]:.2f} | fix s/1k {1000 * best_fix[0] / size:.3f} | left {left}",
                flush=True,
            )
            ok &= left == 0 and found == size
    size, _, _, check, fix = rows[-1]
    slope = (fix[0] / rows[-1][0]) / (rows[0][4][0] / rows[0][0])
    verdicts = [
        (f"{size} fixes: fix/check time", fix[0] / check[0], 2.0),
        (f"{size} fixes: fix/check peak RSS", fix[1] / check[1], 2.0),
        (f"fix s per 1k fixes, {rows[-1][0]} vs {rows[0][0]}", slope, 2.0),
    ]
    for name, value, target in verdicts:
        good = value <= target
        ok &= good
        print(f"{name:<40}{value:8.2f}   (target <= {target:.2f}) {'ok' if good else 'MISSED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
