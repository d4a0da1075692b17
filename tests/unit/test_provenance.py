"""Every result JSON records when and on which code it was measured, beside the machine (``dcut.machine``)."""

from __future__ import annotations

import datetime as dt
import re
import subprocess

from dcut.machine import provenance


def test_provenance_is_a_utc_date_and_this_checkouts_commit():
    record = provenance()
    assert set(record) == {"date", "commit"}
    when = dt.datetime.fromisoformat(record["date"])
    assert when.utcoffset() == dt.timedelta(0)
    assert abs((dt.datetime.now(dt.UTC) - when).total_seconds()) < 60
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert re.fullmatch(rf"{head}(-dirty)?", record["commit"])


def test_outside_a_checkout_the_commit_is_none_not_a_guess(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    assert provenance()["commit"] is None
