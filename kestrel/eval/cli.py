"""`kestrel eval <task>`: evaluation harnesses run against a server's OpenAI API (start one with `kestrel serve`)."""

from __future__ import annotations

import sys


def register(subparsers, add_engine_args) -> None:
    from kestrel.eval import gsm8k
    p = subparsers.add_parser("eval", help="evaluate a served model (GSM8K)")
    tasks = p.add_subparsers(dest="eval_task", required=True, metavar="TASK")
    g = tasks.add_parser("gsm8k", help="GSM8K strict-match accuracy over a local JSONL",
                         description=gsm8k.__doc__.split("\n\n")[0])
    gsm8k.add_args(g)
    # a progress bar only on a terminal: in a log or a pipe its carriage-return frames are noise
    g.set_defaults(func=gsm8k.cmd_gsm8k, no_progress=not sys.stderr.isatty())
