"""The catalogue of bugs the suite must catch (tests/mutations.yaml) stays runnable.

Guards against a catalogue that rots silently: an entry whose search text no longer
occurs exactly once in its file (the code moved on; the runner would report ERROR only
when someone runs it), a listed test file or test function that was renamed or deleted,
or two entries with one id. Running the mutations themselves is ``make mutations``.
"""
from __future__ import annotations

import re

import pytest

from tests import REPO
from tools.mutations import CATALOGUE, load

ENTRIES = load(CATALOGUE)


def test_catalogue_loads_with_unique_ids_and_many_entries():
    """The catalogue parses, its ids are unique (``load`` checks) and it is not empty."""
    assert len(ENTRIES) >= 30, len(ENTRIES)


@pytest.mark.parametrize("m", ENTRIES, ids=[m.id for m in ENTRIES])
def test_each_entry_applies_once_and_names_existing_tests(m):
    """Each change applies (its search text occurs once in its file) and each listed test
    file, and test function where one is named, exists."""
    text = (REPO / m.file).read_text()
    assert text.count(m.search) == 1, f"{m.id}: search text occurs {text.count(m.search)} times in {m.file}"
    for t in m.tests:
        path, _, rest = t.partition("::")
        assert (REPO / path).is_file(), f"{m.id}: no test file {path}"
        if rest:
            name = rest.split("::")[-1].split("[")[0]
            assert re.search(rf"^\s*def {re.escape(name)}\(", (REPO / path).read_text(), re.M), \
                f"{m.id}: no test {name} in {path}"
