"""Which optional extra of the `maingrad` distribution installs which imported module.

`pip install maingrad` (or `pip install .`) is the light install: `maingrad check`, `fix`, `rules`,
`explain` and `hooks summary/validate` need nothing more. The service commands need the `service` extra,
the runtime hooks and preflight `runtime` (torch). A command that reaches for a module of a missing extra
ends in one line naming the install command (`install_hint`), never a bare ModuleNotFoundError.
Standard library only; pyproject.toml's [project.optional-dependencies] is the source of these lists
(tests/test_cli_errors.py checks that the two agree).
"""

from __future__ import annotations

# Top-level import name -> extra.
EXTRA_OF_MODULE: dict[str, str] = {
    "fastapi": "service",
    "starlette": "service",
    "uvicorn": "service",
    "sqlalchemy": "service",
    "alembic": "service",
    "pydantic": "service",
    "pydantic_settings": "service",
    "psycopg": "service",
    "jinja2": "service",
    "multipart": "service",
    "httpx": "service",
    "orjson": "service",
    "torch": "runtime",
    "numpy": "runtime",
    "megatron": "megatron",
    "transformer_engine": "megatron",
}


def install_hint(exc: BaseException, command: str | None = None) -> str | None:
    """One line naming the extra to install when `exc` is a missing module of one; None otherwise."""
    if not isinstance(exc, ModuleNotFoundError) or not exc.name:
        return None
    module = exc.name.split(".")[0]
    extra = EXTRA_OF_MODULE.get(module)
    if extra is None:
        return None
    what = f"`maingrad {command}`" if command else "this command"
    return f'{what} needs the {extra} extra (module {module!r} is not installed): pip install "maingrad[{extra}]"'
