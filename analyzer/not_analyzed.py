"""MG999: a path maingrad could not analyze, as a diagnostic of its own (ruff's E902 / syntax-error shape).

A linter that passes a file it never read is the worst answer a CI can get, so a file that cannot be read,
decoded or parsed, and a directory that cannot be listed, are reported in every output format, counted in
the summary and make the exit code 1 (a rule that fails on a file: 2). MG999 is not a rule: it cannot be
selected, ignored or suppressed (exclude the path instead); it is listed by `maingrad rules` and explained by
`maingrad explain MG999` like one.
"""

from __future__ import annotations

from maingrad.analyzer.catalog import RuleMeta, rule_doc_path
from maingrad.contracts.report import NOT_ANALYZED_CODE, Severity

NOT_ANALYZED = RuleMeta(
    id=NOT_ANALYZED_CODE,
    name="not-analyzed",
    severity=Severity.ERROR,
    summary="A file could not be read, decoded or parsed, or a directory could not be listed: nothing in "
    "it was checked.",
    help_uri=rule_doc_path(NOT_ANALYZED_CODE),
    docs="""\
## What it does

Reports every path `maingrad check` could not analyze, with the reason and, for files, the line and column:

| kind | when |
|---|---|
| `read` | the file cannot be read (permissions, I/O error, a dangling symbolic link) |
| `decode` | the file is not text in its declared encoding: invalid UTF-8 without a PEP 263 coding cookie (e.g. a latin-1 file), an unknown codec, a NUL byte (a binary file) |
| `syntax` | a file that mentions what some rule looks for (e.g. `main_grad`) is not valid Python; files no rule needs are never parsed |
| `directory` | a directory cannot be listed: none of its files were seen |
| `internal` | a rule raised on the file (a maingrad bug: the exit code is 2; please report it) |

MG999 diagnostics appear in every format: text (`path:line:col: MG999 ...`, counted in the summary), JSON
(`parse_errors[]`, with `kind` and `code`), SARIF (a result with rule `MG999` and a tool execution
notification) and GitHub annotations. Any of them makes the exit code 1 (`--exit-zero` still exits 0).

## Why is this bad?

A file that was not analyzed may hold any finding. Passing it silently would turn a CI gate green on code
nobody checked.

## What to do

Fix the file (permissions, encoding, syntax), or, when it is not meant to be Python source (a fixture
with deliberate syntax errors, generated data), exclude it: `exclude = ["tests/fixtures/broken_*.py"]`
under `[tool.maingrad]`. MG999 cannot be ignored or suppressed with a comment.

## Example

```python
# saved as latin-1, without a coding cookie
name = "Grün"  # "ü" is the byte 0xfc there, which is not valid UTF-8
```

## Use instead

Save the file as UTF-8, or declare the encoding it is saved in:

```python
# -*- coding: latin-1 -*-
name = "Grün"
```
""",
    needles=(),
    fixable=False,
)
