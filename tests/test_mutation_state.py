"""tools/mutation_state.py: mutmut's verdicts saved out of mutants/, restored into an empty
one, survivors forgotten on request, and the score with the equivalent ones left out."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import mutation_state as ms  # noqa: E402

NAME = "pkg.mod.x_f__mutmut_{}"
CODES = {1: 1, 2: 0, 3: 3, 4: 33, 5: -24, 6: None, 7: 0}  # killed, survived, ..., not run


@pytest.fixture
def tree(tmp_path, monkeypatch):
    """A checkout with one mutated module's .meta, as mutmut leaves it."""
    monkeypatch.setattr(ms, "STATE", tmp_path / "tools" / "mutation")
    monkeypatch.setattr(ms, "MUTANTS", tmp_path / "mutants")
    monkeypatch.setattr(ms, "EQUIVALENT", tmp_path / "tools" / "mutation" / "equivalent.tsv")
    monkeypatch.setattr(ms, "ROOT", tmp_path)
    meta = tmp_path / "mutants" / "src" / "pkg" / "mod.py.meta"
    meta.parent.mkdir(parents=True)
    meta.write_text(
        json.dumps(
            {
                "exit_code_by_key": {NAME.format(n): c for n, c in CODES.items()},
                "hash_by_function_name": {"x_f": "abc123"},
                "type_check_error_by_key": {},
                "durations_by_key": {NAME.format(1): 0.5},
                "estimated_durations_by_key": {},
            }
        )
    )
    return meta


def test_save_keeps_the_decided_verdicts_and_the_function_hashes(tree):
    (out,) = ms.save()
    assert out.name == "pkg.mod.json"
    body = json.loads(out.read_text())
    assert body["path"] == "src/pkg/mod.py"
    assert body["hash_by_function_name"] == {"x_f": "abc123"}
    want = {NAME.format(n): c for n, c in CODES.items() if c is not None}
    assert body["exit_code_by_key"] == want


def test_restore_writes_a_meta_mutmut_loads_and_keeps_a_newer_one(tree, monkeypatch):
    ms.save()
    tree.unlink()
    (meta,) = ms.restore()
    assert meta == tree
    data = json.loads(meta.read_text())
    # exactly the keys mutmut's SourceFileMutationData.load pops (it asserts none is left)
    assert sorted(data) == sorted(
        [
            "exit_code_by_key",
            "hash_by_function_name",
            "type_check_error_by_key",
            "durations_by_key",
            "estimated_durations_by_key",
        ]
    )
    assert data["exit_code_by_key"][NAME.format(2)] == 0
    assert NAME.format(6) not in data["exit_code_by_key"]
    # and mutmut itself reads it back (its loader asserts that no key is left over)
    loader = pytest.importorskip("mutmut.mutation.data").SourceFileMutationData
    monkeypatch.chdir(tree.parents[3])
    m = loader(path="src/pkg/mod.py")
    m.load()
    assert m.exit_code_by_key == data["exit_code_by_key"]
    assert m.hash_by_function_name == {"x_f": "abc123"}
    assert ms.restore() == []  # mutants/ holds one already: it is newer than the saved one


def test_recheck_forgets_only_the_survivors(tree):
    ms.save()
    assert ms.recheck() == 2
    codes = json.loads((ms.STATE / "pkg.mod.json").read_text())["exit_code_by_key"]
    assert sorted(codes.values()) == [-24, 1, 3, 33]


def test_the_score_leaves_the_equivalent_survivors_out(tree):
    ms.save()
    (ms.STATE / "equivalent.tsv").write_text(
        "# name\twhy\n"
        + NAME.format(2)
        + "\tthe same for every input\n"
        # a killed mutant named equivalent is still killed
        + NAME.format(1)
        + "\tmistaken\n"
    )
    (row,) = ms.score()
    assert (row["killed"], row["timeout"], row["survived"], row["no tests"]) == (2, 1, 1, 1)
    assert row["equivalent"] == 1 and row["decided"] == 6
    assert row["score"] == pytest.approx(3 / 5)


def test_the_command_line_says_what_it_takes(capsys):
    assert ms.main(["mutation_state.py", "nonsense"]) == 2
    assert capsys.readouterr().err.startswith("error: usage: mutation_state.py")
