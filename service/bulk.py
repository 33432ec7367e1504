"""Many-row INSERTs (plain or ON CONFLICT) without SQLAlchemy's per-row parameter work.

`connection.execute(insert, rows)` builds a parameter dict per row (construct_params), runs every value through
its type's bind processor and, on PostgreSQL, hands the rows to psycopg's pipelined executemany, one protocol
round of messages per row: two thirds of a 25,000-result upload's write CPU. Here the statement is compiled once
per (table, columns, dialect), the values are run through the same bind processors (one call per distinct
datetime; a JSON object straight through the engine's serializer), and the rows go to the driver as tuples:
SQLite gets one `executemany` (its loop is C); on PostgreSQL a plain INSERT becomes a `COPY` and an upsert one
`INSERT ... SELECT ... FROM unnest(<arrays>)` per page of rows. The columns and the stored values are what
SQLAlchemy's own execution stores; a statement whose columns need Python-side defaults (none of ours, since every
row names every default column) goes through SQLAlchemy unchanged.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from sqlalchemy import JSON, Connection
from sqlalchemy.sql.dml import Insert

PG_PAGE_ROWS = 2_000

_Prepared = tuple[str, list[str], list[Any], list[Any], list[Any]]
_compiled: dict[tuple[Any, ...], _Prepared | None] = {}


def _format_dialect(dialect: Any) -> Any:
    """The connection's dialect, but writing positional `%s` parameters (psycopg's 'format' style)."""
    cached = getattr(dialect, "_maingrad_format_dialect", None)
    if cached is None:
        cached = type(dialect)(paramstyle="format")
        dialect._maingrad_format_dialect = cached
    return cached


def _prepare(conn: Connection, stmt: Insert, key: Any, columns: Sequence[str]) -> _Prepared | None:
    """(SQL, the row's bind names in order, their processors, the statement's constant trailing values, and per
    column the JSON serializer its processor calls for an object, where the column is JSON)."""
    dialect = conn.dialect
    cache_key = (key, tuple(columns), dialect.name, dialect.paramstyle)
    if cache_key in _compiled:
        return _compiled[cache_key]
    target = dialect if dialect.paramstyle == "qmark" else _format_dialect(dialect)
    compiled: Any = stmt.compile(dialect=target, column_keys=list(columns), for_executemany=True)
    prepared: _Prepared | None = None
    names: list[str] = list(compiled.positiontup or ())
    row_names = names[: len(columns)]  # the VALUES clause: the table's column order
    if (
        dialect.paramstyle in ("qmark", "pyformat", "format")
        and sorted(row_names) == sorted(columns)
        and not compiled.insert_prefetch
        and not compiled.postfetch
        and not getattr(compiled, "effective_returning", None)
    ):
        table: Any = stmt.table
        procs = [table.c[c].type.dialect_impl(dialect).bind_processor(dialect) for c in row_names]
        objects = [
            _object_text(dialect, table.c[c].type, proc) for c, proc in zip(row_names, procs, strict=True)
        ]
        params = compiled.construct_params({c: None for c in columns})
        trailing: list[Any] = []
        for name in names[len(columns) :]:
            value = params[name]
            if not (value is None or type(value) in (str, int, bool)):
                break
            trailing.append(value)
        else:
            prepared = (compiled.string, row_names, procs, trailing, objects)
    _compiled[cache_key] = prepared
    return prepared


def insert_rows(conn: Connection, stmt: Insert, rows: list[dict[str, Any]], key: Any) -> None:
    """Execute `stmt` (an INSERT of `stmt.table`, optionally ON CONFLICT ...) for `rows`, all with the same keys.

    `key` names the statement for the compile cache (the statement object is rebuilt per call by its caller)."""
    if rows:
        insert_columns(conn, stmt, {n: [row[n] for row in rows] for n in rows[0]}, key)


def insert_columns(conn: Connection, stmt: Insert, columns: dict[str, list[Any]], key: Any) -> None:
    """`insert_rows` for rows given column by column (each list one value per row, all of one length)."""
    count = len(next(iter(columns.values()), []))
    if not count:
        return
    prepared = _prepare(conn, stmt, key, list(columns))
    if prepared is None:
        names = list(columns)
        conn.execute(
            stmt, [dict(zip(names, values, strict=True)) for values in zip(*columns.values(), strict=True)]
        )
        return
    sql, names, procs, trailing, objects = prepared
    head, group, tail = ("", "", "") if conn.dialect.paramstyle == "qmark" else _split_values(sql, len(names))
    # SQLite's executemany and PostgreSQL's COPY take a JSON object as its text: the serializer is called
    # directly (SQLAlchemy's processor calls the same one, and on PostgreSQL wraps the object for psycopg to).
    as_text = conn.dialect.paramstyle == "qmark" or not (tail or trailing)
    data = [columns[n] for n in names]
    for i, proc in enumerate(procs):
        if as_text and objects[i] is not None:
            data[i] = _serialized(objects[i], proc, data[i])
        elif proc is not None:
            data[i] = _processed(proc, data[i])
    if conn.dialect.paramstyle == "qmark":
        if trailing:
            data += [[value] * count for value in trailing]
        conn.exec_driver_sql(sql, list(zip(*data, strict=True)))  # a list of tuples: executemany
        return
    cursor: Any = conn.connection.dbapi_connection.cursor()  # type: ignore[union-attr]  # in a transaction
    try:
        if as_text:
            # A plain INSERT: COPY, whose rows psycopg formats in C (a parameter array is dumped element by
            # element in Python). The same columns, values and defaults; the server reads each value as its
            # column's type, as it does the INSERT's parameters.
            with cursor.copy(_COPY_HEAD.sub("COPY ", head, count=1) + "FROM STDIN") as copy:
                for row in zip(*data, strict=True):
                    copy.write_row(row)
            return
        # Otherwise one statement per page whose parameters are one array per column (`unnest` turns them back
        # into rows, in order): the text stays short, so psycopg parses it once and caches it. A column with one
        # value for every row (the same object: an upload's commit, time, project) is sent once, as a one-item
        # array of the same type, instead of once per row.
        same = [all(v is column[0] for v in column) for column in data]
        same[0] = False  # one array at least: it says how many rows
        arrays = [p + "[]" if "::" in p else p for p in group.split(", ")]  # `%s::INTEGER` -> `%s::INTEGER[]`
        rows = [i for i, one in enumerate(same) if not one]
        picks = ", ".join(f"({a})[1]" if same[i] else f"u.c{i}" for i, a in enumerate(arrays))
        unnested = ", ".join(arrays[i] for i in rows)
        aliases = ", ".join(f"c{i}" for i in rows)
        # Binary parameters (`%b`): psycopg's text format escapes each array element through a regular expression.
        sql = f"{head}SELECT {picks} FROM unnest({unnested}) AS u({aliases}){tail}".replace("%s", "%b")
        once: list[Any] = [column[:1] for column, one in zip(data, same, strict=True) if one]
        for start in range(0, count, PG_PAGE_ROWS):
            params = once + [data[i][start : start + PG_PAGE_ROWS] for i in rows]
            params.extend(trailing)
            cursor.execute(sql, params)
    finally:
        cursor.close()


def _object_text(dialect: Any, column_type: Any, proc: Any) -> Any:
    """The function that gives a JSON column's object the text SQLAlchemy would send for it, or None."""
    serializer = getattr(dialect, "_json_serializer", None)
    if serializer is None or proc is None or not isinstance(column_type, JSON):
        return None
    probe: dict[str, Any] = {"k": [1, "\u00e9", None]}
    sent = proc(probe)
    if sent == serializer(probe):  # SQLite: the processor returns the serializer's text
        return serializer
    # psycopg: the processor wraps the object, and psycopg dumps it with the engine's serializer (SQLAlchemy
    # registers it on every connection)
    if dialect.driver == "psycopg" and getattr(sent, "obj", None) is probe:
        return serializer
    return None


def _serialized(serializer: Any, proc: Any, values: list[Any]) -> list[Any]:
    """A JSON column's values: an object's text from the serializer; anything else (None, which SQLAlchemy
    may store as JSON null or as NULL) through the column's processor."""
    return [serializer(v) if type(v) is dict else _processed(proc, [v])[0] for v in values]


def _processed(proc: Any, values: list[Any]) -> list[Any]:
    out = []
    last: Any = _processed  # a sentinel no value is
    done: Any = None
    for v in values:
        if v is not last:  # datetimes of one upload are one object: one conversion
            last, done = v, proc(v)
        out.append(done)
    return out


_COPY_HEAD = re.compile(r"^INSERT INTO ")
_VALUES = re.compile(r"\) (VALUES \(%s[^()]*\))")  # each parameter is `%s` or `%s::TYPE`


def _split_values(sql: str, width: int) -> tuple[str, str, str]:
    """(up to VALUES, the parameters of its one row, the rest)."""
    match = _VALUES.search(sql)
    if match is None or match.group(1).count("%s") != width:
        raise RuntimeError(f"unexpected INSERT text: {sql[:200]}")
    return sql[: match.start(1)], match.group(1)[len("VALUES (") : -1], sql[match.end(1) :]
