"""benchmarks/mutation_report.py on a synthetic mutmut result folder: the counts, the accepted list, and the
stage options (``--paths``, ``--require-checked``) used for the staged scope of issue 51 (docs/testing.md,
"Mutation testing")."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("mutmut")

ROOT = Path(__file__).resolve().parents[1]


def _report():
    spec = importlib.util.spec_from_file_location("mutation_report", ROOT / "benchmarks" / "mutation_report.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _folder(tmp_path: Path) -> tuple[Path, Path]:
    """Two files' results: phases.py (2 killed, 1 survived, 1 no tests), fsdp2.py (1 killed, 1 not checked)."""
    mutants = tmp_path / "mutants"
    a = mutants / "genrl" / "methods" / "phases.py.meta"
    b = mutants / "genrl" / "strategies" / "fsdp2.py.meta"
    a.parent.mkdir(parents=True)
    b.parent.mkdir(parents=True)
    p = "genrl.methods.phases.x_score__mutmut_"
    a.write_text(json.dumps({"exit_code_by_key": {p + "1": 1, p + "2": 1, p + "3": 0, p + "4": 33}}))
    f = "genrl.strategies.fsdp2.x_publish_checkpoint__mutmut_"
    b.write_text(json.dumps({"exit_code_by_key": {f + "1": 1, f + "2": None}}))
    accepted = tmp_path / "accepted.txt"
    accepted.write_text(f"# comment\n{p}3  equivalent: same value for every input\n"
                        "genrl.flow.policy.x_other__mutmut_9  an entry outside the stage\n")
    return mutants, accepted


def test_counts_and_check_over_the_whole_folder(tmp_path, capsys):
    """Whole folder: the no-tests mutant is an unaccepted survivor (--check fails), the accepted one is counted as
    accepted, the entry whose mutant no longer exists is stale, and the score is killed / (checked - accepted)."""
    mr = _report()
    mutants, accepted = _folder(tmp_path)
    out_json = tmp_path / "out.json"
    assert mr.main(["--mutants", str(mutants), "--accepted", str(accepted), "--json", str(out_json)]) == 0
    data = json.loads(out_json.read_text())
    assert data["total"] == {"killed": 3, "accepted": 1, "no tests": 1, "not checked": 1}
    assert data["score"] == pytest.approx(3 / 4)
    assert data["unaccepted"] == ["genrl.methods.phases.x_score__mutmut_4"]
    assert "stale: genrl.flow.policy.x_other__mutmut_9" in capsys.readouterr().out
    assert mr.main(["--mutants", str(mutants), "--accepted", str(accepted), "--check"]) == 1


def test_paths_restrict_the_table_the_check_and_the_stale_entries(tmp_path, capsys):
    """--paths keeps only the files under the prefixes: fsdp2 alone has no survivor, so --check passes, and the
    accepted entries of other modules are not reported as stale; --require-checked then fails on its unchecked
    mutant, and a prefix that matches nothing fails with a message naming it."""
    mr = _report()
    mutants, accepted = _folder(tmp_path)
    args = ["--mutants", str(mutants), "--accepted", str(accepted), "--paths", "genrl/strategies/"]
    out_json = tmp_path / "out.json"
    assert mr.main([*args, "--check", "--json", str(out_json)]) == 0
    assert json.loads(out_json.read_text())["total"] == {"killed": 1, "not checked": 1}
    assert "stale accepted entries: 0;" in capsys.readouterr().out
    assert mr.main([*args, "--check", "--require-checked"]) == 1
    assert "1 mutants not checked yet" in capsys.readouterr().out
    phases = ["--mutants", str(mutants), "--accepted", str(accepted), "--paths", "genrl/methods/phases.py"]
    assert mr.main([*phases, "--check"]) == 1  # the no-tests mutant of phases is not accepted
    assert mr.main(["--mutants", str(mutants), "--paths", "genrl/nothing/", "--check"]) == 1
    assert "no mutant under ['genrl/nothing/']" in capsys.readouterr().out
