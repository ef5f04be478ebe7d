"""The suite's own order (conftest.LONGEST_FIRST): every file it names exists, once, so that a
renamed or removed test file cannot silently fall to the end of the run."""

from pathlib import Path

from conftest import LONGEST_FIRST


def test_the_longest_files_named_first_exist_once() -> None:
    tests = Path(__file__).parent
    missing = [name for name in LONGEST_FIRST if not (tests / name).is_file()]
    assert missing == [], f"conftest.LONGEST_FIRST names files that are gone: {missing}"
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST), "a file is named twice"
