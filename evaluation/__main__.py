"""``python -m evaluation <command>``: run an evaluation, compare runs, rewrite a report, list dimensions, import
results of the official ``vbench`` package, run a method arena. ``python -m evaluation <command> --help`` for each
command's flags."""

from __future__ import annotations

import sys

COMMANDS = {
    "run": "evaluate a folder of videos (dimensions, rewards, FVD / FID) and write results.json + report",
    "compare": "two or more evaluation folders -> one table of deltas with seed spread",
    "report": "rewrite report.md / report.html / plots from a results.json",
    "dimensions": "list the VBench dimensions, which are native / proxy, and the weights each needs",
    "vbench-import": "turn the official vbench package's *_eval_results.json into a results.json for compare",
    "arena": "train every entrant of an arena config at equal compute, evaluate, write the leaderboard",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        width = max(map(len, COMMANDS))
        text = "usage: python -m evaluation <command> [flags]\n\n" + "\n".join(
            f"  {c:<{width}}  {h}" for c, h in COMMANDS.items())
        if argv and argv[0] not in ("-h", "--help"):
            print(f"unknown command {argv[0]!r}\n\n{text}", file=sys.stderr)
            return 2
        print(text)
        return 0
    command, rest = argv[0], argv[1:]
    try:
        if command == "run":
            from evaluation.run import main as run
        elif command == "compare":
            from evaluation.compare import main as run
        elif command == "report":
            from evaluation.report import main as run
        elif command == "arena":
            from evaluation.arena import main as run
        elif command == "dimensions":
            from evaluation.vbench_official import list_dimensions as run
        else:
            from evaluation.vbench_official import main as run
        run(rest)
    except (FileNotFoundError, ValueError, ImportError, RuntimeError) as e:  # bad inputs / a failed run: said plainly
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
