"""Every parse of candidate or template source goes through one lock (search_space.template.
parse_source): CPython 3.11's parser keeps its recursion depth in state every thread shares, so
two parses at once in threads (a parallel backend's candidates, their ids, a campaign's
templates) can fail with "SystemError: AST constructor recursion depth mismatch"."""

from __future__ import annotations

import ast
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("agent", "kernels", "model", "sandbox", "search_space", "evals")


def test_no_package_parses_source_outside_the_lock() -> None:
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path == ROOT / "search_space" / "template.py":
                continue
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                direct = (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "parse"
                    and isinstance(node.func.value, ast.Name)
                    and node.func.value.id == "ast"
                )
                imported = isinstance(node, ast.ImportFrom) and node.module == "ast"
                imported = imported and any(a.name == "parse" for a in node.names)
                if direct or imported:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert found == [], f"ast.parse outside search_space.template.parse_source: {found}"


def test_candidate_ids_are_computed_safely_in_threads() -> None:
    """Candidate ids read a source's imports (the kit's use): many threads at once, each a new
    source, all get their ids."""
    from sandbox.candidate import Candidate

    source = (ROOT / "kernels" / "embedding_bag.py").read_text()
    ids: list[str] = []
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for j in range(20):
                text = source + f"\n# {i} {j}\n"
                ids.append(Candidate(problem="embedding_bag", source=text, entry="embedding_bag_forward").id)
        except BaseException as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(set(ids)) == 8 * 20
