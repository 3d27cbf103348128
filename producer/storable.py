"""Whether a text can be stored: the one check every text a job stores from its user
passes (producer/validate.py's line fields, the job's options, a response_format's schema)."""

from __future__ import annotations


def text_problem(value: str) -> str | None:
    """Why `value` cannot be stored as text, None when it can. Postgres refuses NUL in text
    and JSONB, and UTF-8 (every sink) refuses lone surrogates: either would fail a whole
    batch insert. Every text a job stores from its user passes here first (line fields,
    --stop, --system, model and input names)."""
    nul = value.find("\x00")
    if nul >= 0:
        return f"expected text without NUL (\\u0000), got one at character {nul + 1}"
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            # A JSON "\\udXXX" escape or an undecodable command-line byte gets here.
            return (
                f"expected valid Unicode text, got a lone surrogate "
                f"\\u{ord(value[exc.start]):04x} at character {exc.start + 1}"
            )
    return None


def json_problem(value: object, path: str) -> str | None:
    """The first text in a JSON value (a response_format's schema) that cannot be stored,
    as 'field "<path to it>": <problem>', None when every one can."""
    if type(value) is str:
        problem = text_problem(value)
        return None if problem is None else f'field "{path}": {problem}'
    items: list[tuple[str, object]] = []
    if type(value) is dict:
        for key, item in value.items():
            problem = text_problem(key)
            if problem is not None:
                return f'field "{path}": expected keys of {problem.removeprefix("expected ")}'
            items.append((f"{path}.{key}", item))
    elif type(value) is list:
        items = [(f"{path}[{i}]", item) for i, item in enumerate(value)]
    return next((p for where, item in items if (p := json_problem(item, where))), None)
