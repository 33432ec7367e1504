"""Rule registry: every module `mgNNN_*.py` in this package defines one `Rule` subclass.

Discovery by module name means adding a rule never touches a shared list.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from functools import cache

from maingrad.analyzer.rules.base import Rule

_RULE_MODULE = re.compile(r"^mg\d{3}_\w+$")


@cache
def all_rules() -> tuple[type[Rule], ...]:
    found: list[type[Rule]] = []
    for info in pkgutil.iter_modules(__path__):
        if not _RULE_MODULE.match(info.name):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        for value in vars(module).values():
            if (
                isinstance(value, type)
                and issubclass(value, Rule)
                and value is not Rule
                and hasattr(value, "id")
            ) and value.__module__ == module.__name__:
                found.append(value)
    return tuple(sorted(found, key=lambda r: r.id))


def rules_by_id() -> dict[str, type[Rule]]:
    return {rule.id: rule for rule in all_rules()}
