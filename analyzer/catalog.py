"""Rule metadata without importing the rules: what the CLI needs to select, report and explain.

Importing the rule modules imports libcst (about 0.25 s), which alone would exceed the warm-scan budget.
The catalog is a plain-data copy of each rule's metadata, stored in the cache keyed by a hash of the
analyzer's own sources, so a warm run whose files all hit the cache never imports libcst.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path
from typing import Any

from maingrad.analyzer import __version__
from maingrad.analyzer.fileio import atomic_write
from maingrad.analyzer.report import RuleInfo, Severity

PACKAGE_DIR = Path(__file__).resolve().parent

# A pseudo rule: suppression comments that suppress nothing or name unknown rules (--warn-unused-ignores).
UNUSED_SUPPRESSION_ID = "MG000"


@dataclass(frozen=True)
class RuleMeta:
    id: str
    name: str
    severity: Severity
    summary: str
    help_uri: str
    docs: str
    needles: tuple[str, ...]
    fixable: bool

    def info(self, severity: Severity | None = None) -> RuleInfo:
        return RuleInfo(self.id, self.name, severity or self.severity, self.summary, self.help_uri)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["severity"] = self.severity.value
        data["needles"] = list(self.needles)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RuleMeta:
        return cls(
            id=data["id"],
            name=data["name"],
            severity=Severity(data["severity"]),
            summary=data["summary"],
            help_uri=data["help_uri"],
            docs=data["docs"],
            needles=tuple(data["needles"]),
            fixable=bool(data["fixable"]),
        )


UNUSED_SUPPRESSION = RuleMeta(
    id=UNUSED_SUPPRESSION_ID,
    name="unused-suppression",
    severity=Severity.WARNING,
    summary="A `# maingrad: ignore` comment suppresses nothing or names an unknown rule.",
    help_uri=f"https://github.com/maingrad/maingrad/blob/main/docs/rules/{UNUSED_SUPPRESSION_ID}.md",
    docs="""\
## What it does

Reported only with `--warn-unused-ignores`: a suppression comment (`# maingrad: ignore[...]`,
`# maingrad: ignore`, `# maingrad: ignore-file`) that suppressed no finding in this run, or that names a rule
id maingrad does not know.

## Why is this bad?

Stale suppressions hide the next real finding on that line, and a misspelt rule id suppresses nothing while
looking as if it did.

## Example

```python
if param.main_grad is None:  # maingrad: ignore[MG003]
    ...
```

## Use instead

```python
if param.main_grad is None:
    ...
```
""",
    needles=(),
    fixable=False,
)


@cache
def source_hash() -> str:
    """Hash of every analyzer source file (framework and rules) plus the tool and Python versions: any
    change to how findings are computed changes it, so cached results never outlive the code."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{__version__}\0{sys.version_info[0]}.{sys.version_info[1]}\0".encode())
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        digest.update(str(path.relative_to(PACKAGE_DIR)).encode())
        digest.update(b"\0")
        digest.update(path.read_bytes())
    return digest.hexdigest()


def rule_ids_on_disk() -> tuple[str, ...]:
    """Rule ids from module names (`mg001_x.py` -> MG001), without importing them."""
    return tuple(sorted(p.name[:5].upper() for p in (PACKAGE_DIR / "rules").glob("mg[0-9][0-9][0-9]_*.py")))


def load_rules_metadata() -> tuple[RuleMeta, ...]:
    """Import the rules (and libcst) and copy their metadata."""
    from maingrad.analyzer.rules import all_rules

    return tuple(
        RuleMeta(
            id=rule.id,
            name=rule.name,
            severity=Severity(rule.severity),
            summary=rule.summary,
            help_uri=rule.help_uri(),
            docs=rule.docs,
            needles=tuple(rule.needles),
            fixable=bool(rule.fixable),
        )
        for rule in all_rules()
    )


def load_catalog(cache_dir: Path | None) -> tuple[RuleMeta, ...]:
    """Every real rule's metadata, from `cache_dir` when it holds a copy for the current sources."""
    if cache_dir is None:
        return load_rules_metadata()
    path = cache_dir / f"catalog-{source_hash()}.json"
    try:
        return tuple(RuleMeta.from_dict(item) for item in json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    rules = load_rules_metadata()
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps([r.to_dict() for r in rules]).encode("utf-8"))
        for old in cache_dir.glob("catalog-*.json"):  # catalogs of sources that no longer exist
            if old != path:
                old.unlink(missing_ok=True)
    except OSError:
        pass  # a read-only tree just runs without a cached catalog
    return rules
