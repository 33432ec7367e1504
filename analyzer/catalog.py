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
from typing import TYPE_CHECKING, Any

from maingrad.analyzer import __version__
from maingrad.analyzer.fileio import atomic_write
from maingrad.analyzer.needles import Needle
from maingrad.contracts.report import RuleInfo, Severity

if TYPE_CHECKING:  # the rules import this module's neighbours; the catalog loads them lazily
    from maingrad.analyzer.rules.base import Rule

PACKAGE_DIR = Path(__file__).resolve().parent

# A pseudo rule: suppression comments that suppress nothing or name unknown rules (--warn-unused-ignores).
UNUSED_SUPPRESSION_ID = "MG000"


def rule_doc_path(rule_id: str) -> str:
    """A rule's page, relative to the root of maingrad's source tree (the report's `help_uri`)."""
    return f"docs/rules/{rule_id}.md"


@dataclass(frozen=True)
class RuleMeta:
    id: str
    name: str
    severity: Severity
    summary: str
    help_uri: str
    docs: str
    needles: tuple[Needle, ...]
    fixable: bool
    default: bool = True  # False: opt-in, selected only by name (see `Config.selected`)

    def info(self, severity: Severity | None = None) -> RuleInfo:
        return RuleInfo(self.id, self.name, severity or self.severity, self.summary, self.help_uri)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["severity"] = self.severity.value
        data["needles"] = [n if isinstance(n, str) else list(n) for n in self.needles]
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
            needles=tuple(n if isinstance(n, str) else tuple(n) for n in data["needles"]),
            fixable=bool(data["fixable"]),
            default=bool(data.get("default", True)),
        )


UNUSED_SUPPRESSION = RuleMeta(
    id=UNUSED_SUPPRESSION_ID,
    name="unused-suppression",
    severity=Severity.WARNING,
    summary="A `# maingrad: ignore` comment suppresses nothing or names an unknown rule.",
    help_uri=rule_doc_path(UNUSED_SUPPRESSION_ID),
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


# Rules registered at run time (plugins, and tests that define their own rules) on top of the built-in
# `analyzer/rules/mgNNN_*.py` modules. Worker processes started by fork inherit them.
_EXTRA_RULES: dict[str, type[Rule]] = {}


def register_rule(rule: type[Rule]) -> None:
    """Add a Rule subclass to every scan in this process (replaces a registered rule of the same id)."""
    _EXTRA_RULES[rule.id] = rule


def unregister_rule(rule_id: str) -> None:
    _EXTRA_RULES.pop(rule_id, None)


def rule_classes() -> dict[str, type[Rule]]:
    """Built-in and registered rule classes by id (imports libcst)."""
    from maingrad.analyzer.rules import rules_by_id

    return {**rules_by_id(), **_EXTRA_RULES}


def extra_rules_signature() -> str:
    """Identity of the registered rules' code, for cache keys (their sources are not in the package)."""
    import inspect

    digest = hashlib.blake2b(digest_size=16)
    for rule_id in sorted(_EXTRA_RULES):
        rule = _EXTRA_RULES[rule_id]
        try:
            code = inspect.getsource(rule)
        except (OSError, TypeError):
            code = repr(id(rule))  # no source: never share cache entries across processes
        digest.update(f"{rule_id}\0{rule.__module__}.{rule.__qualname__}\0{code}\0".encode())
    return digest.hexdigest() if _EXTRA_RULES else ""


def _meta(rule: type[Rule]) -> RuleMeta:
    return RuleMeta(
        id=rule.id,
        name=rule.name,
        severity=Severity(rule.severity),
        summary=rule.summary,
        help_uri=rule.help_uri(),
        docs=rule.docs,
        needles=tuple(rule.needles),
        fixable=bool(rule.fixable),
        default=bool(rule.default),
    )


def load_rules_metadata() -> tuple[RuleMeta, ...]:
    """Import the built-in rules (and libcst) and copy their metadata."""
    from maingrad.analyzer.rules import all_rules

    return tuple(_meta(rule) for rule in all_rules() if rule.id not in _EXTRA_RULES)


def _with_extras(builtin: tuple[RuleMeta, ...]) -> tuple[RuleMeta, ...]:
    if not _EXTRA_RULES:
        return builtin
    kept = [r for r in builtin if r.id not in _EXTRA_RULES]
    return tuple(sorted([*kept, *(_meta(rule) for rule in _EXTRA_RULES.values())], key=lambda r: r.id))


def load_catalog(cache_dir: Path | None) -> tuple[RuleMeta, ...]:
    """Every rule's metadata (built-in ones from `cache_dir` when it holds a copy for the current
    sources, so a warm run does not import libcst), plus registered rules."""
    if cache_dir is None:
        return _with_extras(load_rules_metadata())
    path = cache_dir / f"catalog-{source_hash()}.json"
    try:
        cached = tuple(RuleMeta.from_dict(item) for item in json.loads(path.read_text(encoding="utf-8")))
        return _with_extras(cached)
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
    return _with_extras(rules)
