"""Summarise a mutmut run (``mutants/``) and check the survivors against the accepted list.

Usage (from the repository root, after ``mutmut run``; see docs/testing.md)::

    python benchmarks/mutation_report.py                 # counts per file and in total, survivors not accepted
    python benchmarks/mutation_report.py --check         # exit 1 if a survivor (anywhere in the scope) is not in
                                                         # tests/mutation_accepted.txt, an entry's reason is
                                                         # "no test yet", or no mutant has been checked at all
    python benchmarks/mutation_report.py --json out.json # the counts as JSON (for benchmarks/RESULTS.md)
    python benchmarks/mutation_report.py --paths genrl/methods/phases.py genrl/strategies/ --check --require-checked
                                                         # one stage of the scope: the table, the total and the
                                                         # check cover only files under these prefixes, and a
                                                         # mutant there that no run has checked fails the check

The accepted list ``tests/mutation_accepted.txt`` has one mutant a line: ``<mutant name>  <reason>`` (the name as
``mutmut results`` prints it, then at least one space and the reason); ``#`` starts a comment. A mutant is
*accepted* when it survives and is listed; an entry whose mutant is now killed, or no longer exists, is reported
as stale (the code or the tests changed: delete the line or fix the name).

Statuses are mutmut's: killed, timeout (counted as killed: the mutant made the tests run far longer), survived,
no tests (no test runs the mutated function; counted with the survivors), not checked (the run did not reach
it), suspicious / segfault / skipped.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path

from mutmut.stats import status_by_exit_code  # mutmut's own exit code -> status map

ROOT = Path(__file__).resolve().parents[1]
STRICT = ("genrl/flow/", "genrl/rollout/")
FORBIDDEN_REASONS = ("no test yet", "todo", "test later", "write a test", "not tested yet")


def load_results(mutants: Path) -> dict[str, tuple[str, str]]:
    """``{mutant name: (source file relative to the root, status)}`` from mutmut's ``*.py.meta`` files.

    Raises:
        FileNotFoundError: ``mutants`` has no meta file (mutmut has not run here).
    """
    out: dict[str, tuple[str, str]] = {}
    metas = sorted(mutants.glob("genrl/**/*.py.meta"))
    if not metas:
        raise FileNotFoundError(f"no mutmut results under {mutants}: run `mutmut run` first (docs/testing.md)")
    for meta in metas:
        source = str(meta.relative_to(mutants))[: -len(".meta")]
        for name, code in json.loads(meta.read_text())["exit_code_by_key"].items():
            out[name] = (source, status_by_exit_code[code])
    return out


def load_accepted(path: Path) -> dict[str, str]:
    """``{mutant name: reason}`` from the accepted list.

    Raises:
        ValueError: a line has a name but no reason (the message names the line).
    """
    accepted: dict[str, str] = {}
    if not path.exists():
        return accepted
    for i, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split(" #", 1)[0].strip() if not line.lstrip().startswith("#") else ""
        if not line:
            continue
        name, _, reason = line.partition(" ")
        if not reason.strip():
            raise ValueError(f"{path}:{i}: {name!r} has no reason; write `<mutant name>  <why it is accepted>`")
        accepted[name] = reason.strip()
    return accepted


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mutants", type=Path, default=ROOT / "mutants")
    parser.add_argument("--accepted", type=Path, default=ROOT / "tests" / "mutation_accepted.txt")
    parser.add_argument("--check", action="store_true", help="fail on unaccepted survivors, bad reasons, empty run")
    parser.add_argument("--json", type=Path, help="write the counts here")
    parser.add_argument("--list", action="store_true", help="print every unaccepted survivor")
    parser.add_argument("--diffs", action="store_true", help="with --list: each survivor's diff (mutmut show)")
    parser.add_argument("--only", default="", help="with --list: only survivors whose file starts with this")
    parser.add_argument("--paths", nargs="+", default=None, metavar="PREFIX",
                        help="report and check only files under these prefixes (a stage of the scope)")
    parser.add_argument("--require-checked", action="store_true",
                        help="with --check: also fail while a mutant in the report is not checked")
    args = parser.parse_args(argv)

    results = load_results(args.mutants)
    accepted = load_accepted(args.accepted)
    if args.paths:
        results = {n: (s, st) for n, (s, st) in results.items() if s.startswith(tuple(args.paths))}
        if not results:
            print(f"no mutant under {args.paths}: check the prefixes (e.g. genrl/methods/phases.py)")
            return 1
        dotted = tuple(q.rstrip("/").removesuffix(".py").replace("/", ".") for q in args.paths)
        accepted = {n: r for n, r in accepted.items() if n.startswith(dotted)}
    per_file: dict[str, Counter] = defaultdict(Counter)
    unaccepted: list[tuple[str, str, str]] = []
    for name, (source, status) in sorted(results.items()):
        alive = status in ("survived", "no tests")
        if alive and name in accepted:
            status = "accepted"
        per_file[source][status] += 1
        if alive and name not in accepted:
            unaccepted.append((source, name, status))
    stale = sorted(n for n in accepted if results.get(n, ("", "missing"))[1] in ("killed", "timeout", "missing"))
    bad_reasons = sorted(n for n, r in accepted.items() if any(f in r.lower() for f in FORBIDDEN_REASONS))

    total: Counter = Counter()
    cols = ("killed", "timeout", "survived", "no tests", "accepted", "not checked", "suspicious", "segfault")
    print(f"{'file':42s} " + " ".join(f"{c:>11s}" for c in cols) + "      score")
    for source in sorted(per_file):
        c = per_file[source]
        total.update(c)
        print(f"{source:42s} " + " ".join(f"{c[k]:11d}" for k in cols) + f"   {_pct(c)}")
    print(f"{'total':42s} " + " ".join(f"{total[k]:11d}" for k in cols) + f"   {_pct(total)}")
    print("score = (killed + timeout) / (checked mutants - accepted); accepted = survivors listed with a reason")
    strict = [u for u in unaccepted if u[0].startswith(STRICT)]
    if args.list:
        diff = _differ(args.mutants.parent) if args.diffs else None
        for source, name, status in unaccepted:
            if source.startswith(args.only):
                print(f"  {status:9s} {name}")
                if diff is not None:
                    print("\n".join(f"      {d}" for d in diff(name, source)))
    print(f"unaccepted survivors: {len(unaccepted)} ({len(strict)} in genrl/flow + genrl/rollout); "
          f"stale accepted entries: {len(stale)}; forbidden reasons: {len(bad_reasons)}")
    for n in stale:
        print(f"  stale: {n}")
    for n in bad_reasons:
        print(f"  reason not allowed: {n}  {accepted[n]}")
    if args.json:
        args.json.write_text(json.dumps({"total": dict(total), "score": score(total),
                                         "per_file": {k: dict(v) for k, v in per_file.items()},
                                         "unaccepted": [u[1] for u in unaccepted]}, indent=1))
    if args.check:
        if not args.list:
            for _source, name, status in unaccepted:
                print(f"  {status:9s} {name}")
        if unaccepted:
            print("each needs a test that kills it or a line in tests/mutation_accepted.txt with its reason; "
                  "`mutmut show <name>` prints the change, `--list --diffs` prints them all")
        if not _checked(total):
            print("no mutant has been checked: did `mutmut run` match your glob (e.g. \"genrl.flow.policy.*\")?")
            return 1
        if args.require_checked and total["not checked"]:
            print(f"{total['not checked']} mutants not checked yet: run `mutmut run` over them first")
            return 1
        if unaccepted or bad_reasons:
            return 1
    return 0


def _differ(root: Path):
    """``diff(name, source) -> [changed lines]`` through mutmut's own diff (run from the mutated checkout)."""
    import os

    os.chdir(root)
    from mutmut.__main__ import get_diff_for_mutant

    def diff(name: str, source: str) -> list[str]:
        text = get_diff_for_mutant(name, path=Path(source))
        return [ln for ln in text.splitlines() if ln[:1] in "+-" and ln[:3] not in ("+++", "---")]

    return diff


def _checked(c: Counter) -> int:
    return sum(v for k, v in c.items() if k not in ("not checked", "accepted", "skipped"))


def score(c: Counter) -> float:
    """(killed + timeout) / (checked - accepted), 0 when nothing was checked."""
    checked = _checked(c)
    return (c["killed"] + c["timeout"]) / checked if checked else 0.0


def _pct(c: Counter) -> str:
    """The score as a percentage, ``-`` when nothing in ``c`` was checked (not a score of 0)."""
    return f"{score(c):7.1%}" if _checked(c) else f"{'-':>7s}"


if __name__ == "__main__":
    sys.exit(main())
