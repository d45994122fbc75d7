"""One parameter set for several setups: a scenario file with `rows` holds the parts every row shares (hardware,
efficiencies, sources) at its top level, the task families' parts (`families`: response lengths, reward time) and
each row's own (model shape, GPUs, steps, split, and `family`); a row's scenario is the three merged, the row's
own last. A row's `published` figures (what a check compares it with) are not part of its scenario."""

from __future__ import annotations

ROW_ONLY = ("family", "published")  # a row's keys that are not scenario fields


class RowError(ValueError):
    """A row asked of a file that has none, or not named, or unknown; the message says which."""


def merged(base: dict, over: dict) -> dict:
    """`over` laid on `base`: maps merged key by key, anything else replaced."""
    out = dict(base)
    for key, value in over.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def row_names(data: object) -> list[str]:
    return list(data["rows"]) if isinstance(data, dict) and isinstance(data.get("rows"), dict) else []


def expand_row(data: object, row: str | None) -> object:
    """The scenario data of `row` in a file of rows; any other file as it is (and no row may be asked of it)."""
    names = row_names(data)
    if not names:
        if row is not None:
            raise RowError(f"row {row!r} asked, but the file has no `rows`")
        return data
    if row is None:
        raise RowError(f"a file of rows: name one of {', '.join(names)}")
    if row not in names:
        raise RowError(f"no row {row!r} (rows: {', '.join(names)})")
    entry = data["rows"][row]
    if not isinstance(entry, dict):
        raise RowError(f"rows.{row}: a map of scenario fields expected")
    families = data.get("families") or {}
    family = entry.get("family")
    if family is not None and family not in families:
        raise RowError(f"rows.{row}.family: no family {family!r} (families: {', '.join(families) or 'none'})")
    shared = {key: value for key, value in data.items() if key not in ("rows", "families")}
    scenario = merged(shared, families[family]) if family is not None else shared
    scenario = merged(scenario, {key: value for key, value in entry.items() if key not in ROW_ONLY})
    scenario["name"] = f"{shared.get('name', 'scenario')}-{row}"
    return scenario
