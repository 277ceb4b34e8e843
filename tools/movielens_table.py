"""MovieLens-100K as one click table: a real table with a time column, for ``bench quality``.

The ratings of GroupLens' MovieLens-100K (as RecBole's PyPI wheel ships them), joined with the users'
and movies' attributes; a rating of 4 or 5 is a click. Columns: ``label``, ``timestamp`` (epoch
seconds), ``user_id``, ``item_id``, ``age``, ``gender``, ``occupation``, ``zip_code``,
``release_year`` (missing for a few movies), ``genres`` (``|``-separated: multi-hot).

    python tools/movielens_table.py /tmp/ml100k.csv        # downloads the wheel with pip (about 2 MB)
    python -m pipeline bench quality data.source=table data.path=/tmp/ml100k.csv data.name=ml100k \\
        "data.continuous=[age,release_year]" "data.categorical=[user_id,item_id,gender,occupation,zip_code]" \\
        "data.multihot=[genres]" data.time_column=timestamp
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pandas as pd

WHEEL = "recbole==1.2.1"
FOLDER = "recbole/dataset_example/ml-100k/ml-100k"


def _read(archive: zipfile.ZipFile, suffix: str) -> pd.DataFrame:
    with archive.open(f"{FOLDER}.{suffix}") as f:
        frame = pd.read_csv(f, sep="\t")
    frame.columns = [c.split(":")[0] for c in frame.columns]
    return frame


def main(out: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, WHEEL], check=True)
        with zipfile.ZipFile(next(Path(tmp).glob("*.whl"))) as archive:
            ratings, users, items = (_read(archive, s) for s in ("inter", "user", "item"))
    table = ratings.merge(users, on="user_id").merge(items[["item_id", "release_year", "class"]], on="item_id")
    table["label"] = (table["rating"] >= 4).astype(int)
    table["genres"] = table["class"].fillna("").str.replace(" ", "|")
    table["release_year"] = pd.to_numeric(table["release_year"], errors="coerce")
    table["timestamp"] = table["timestamp"].astype("int64")
    columns = ["label", "timestamp", "user_id", "item_id", "age", "gender", "occupation", "zip_code",
               "release_year", "genres"]
    table.sort_values("timestamp")[columns].to_csv(out, index=False)
    print(f"{out}: {len(table):,} rows, click rate {table['label'].mean():.3f}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "ml100k.csv")
