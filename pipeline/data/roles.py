"""The columns' roles: which is the label and which are continuous, categorical or multi-hot features, for Criteo's
fixed columns or as a table's settings declare them (with roles proposed from its first rows where none are).

Example::

    roles = table_roles(data_config)
    roles.check_against(header_names, "clicks.csv")
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.data import raw_folder
from pipeline.data.config import DataConfig
from pipeline.data.input_files import TEXT_SUFFIXES, input_files, table_format
from pipeline.data.role_hint import list_setting, role_hint
from pipeline.data.text_format import CRITEO_CATEGORICAL, CRITEO_CONTINUOUS
from pipeline.errors import BadInputError


@dataclass
class Roles:
    """Which column is the label and which are features of each kind."""

    label: str
    continuous: list[str]
    categorical: list[str]
    multihot: list[str] = field(default_factory=list)
    ignore: list[str] = field(default_factory=list)
    time: str = ""
    """The column that orders the rows in time (a feature too only if listed in a role); empty: none."""

    @property
    def columns(self) -> list[str]:
        """The columns written: the label and the features."""
        return [self.label, *self.continuous, *self.categorical, *self.multihot]

    def check_against(self, found: list[str], where: str) -> None:
        """Raise a :class:`BadInputError` if declared columns are absent or named more than once, or the
        file has undeclared ones."""
        declared = self.columns + ([self.time] if self.time and self.time not in self.columns else [])
        repeated = sorted({c for c in declared if found.count(c) > 1})
        if repeated:
            raise BadInputError(f"{where}: the column name(s) {repeated} appear more than once (columns {found}), so "
                                "which one holds the data is unclear: give each column its own name")
        missing = [c for c in declared if c not in found]
        if missing:
            other = next((d for d in (";", ",", "\t", "|") if len(found) == 1 and d in found[0]), None)
            spaced = [f for f in found if f != f.strip() and f.strip() in missing]
            hint = (f": its header looks cut by {other!r}, but a .csv file's lines are cut at ',' and a .tsv, .tab or "
                    ".txt file's at tabs: save it with one of those, under its suffix") if other else (
                    f": its names {spaced} have spaces around them (as in a file written with ', ' between its "
                    "values): write it without spaces around the separators, or as parquet") if spaced else ""
            label = (f" (data.label={self.label} names the column of 0 / 1 labels)" if self.label in missing else "")
            raise BadInputError(f"{where}: declared column(s) {missing} not found{label}; the file has columns "
                                f"{found}{hint}")
        unknown = [c for c in found if c not in declared and c not in self.ignore]
        if unknown:
            raise BadInputError(
                f"{where}: column(s) {unknown} have no role; expected only {self.columns}. Declare them in "
                f"data.continuous / data.categorical / data.multihot, or drop them: {list_setting('data.ignore', unknown)}"
            )


def criteo_roles() -> Roles:
    """Criteo's columns: label, I1..I13, C1..C26."""
    return Roles("label", list(CRITEO_CONTINUOUS), list(CRITEO_CATEGORICAL))


def table_roles(d: DataConfig) -> Roles:
    """The roles declared in the settings; a clear error when they are unusable."""
    roles = Roles(d.label, list(d.continuous), list(d.categorical), list(d.multihot), list(d.ignore), d.time_column)
    if not (roles.continuous or roles.categorical or roles.multihot):
        raise BadInputError("data.source=table needs column roles: set data.continuous, data.categorical "
                            "and/or data.multihot (and data.label); "
                            + (table_role_hint(d) or "e.g. data.categorical=[user,item] data.continuous=[price]"))
    if roles.label != raw_folder.LABEL and raw_folder.LABEL in roles.columns:
        raise BadInputError(f"the raw layout names the label column {raw_folder.LABEL!r}; a feature of that name "
                            f"clashes with data.label={roles.label!r}: rename it in the input")
    settings = {"data.label": [roles.label], "data.continuous": roles.continuous,
                "data.categorical": roles.categorical, "data.multihot": roles.multihot, "data.ignore": roles.ignore}
    names = roles.columns + roles.ignore
    repeated = sorted({c for c in names if names.count(c) > 1})
    if repeated:
        where = ", ".join(f"{c!r} in {' and '.join(k for k, v in settings.items() if c in v)}" for c in repeated)
        raise BadInputError(f"column(s) {repeated} are given more than one role ({where}): name each in one setting")
    if roles.time and roles.time in (roles.label, *roles.ignore):
        what = "the label" if roles.time == roles.label else "a column data.ignore drops"
        raise BadInputError(f"data.time_column={roles.time!r} names {what}: name the column that holds the rows' times")
    return roles


def table_role_hint(d: DataConfig) -> str:
    """Roles to propose from the first input file (:func:`pipeline.data.role_hint.role_hint`), or ``""``."""
    try:
        path = input_files(d)[0][0]
        fmt = table_format(path)
    except (BadInputError, IndexError):
        return ""
    return role_hint(path, None if fmt == "parquet" else TEXT_SUFFIXES[fmt], d.label, d.list_separator)


