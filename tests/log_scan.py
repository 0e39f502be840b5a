"""The log scan of the multi-process tests: every ERROR / CRITICAL / traceback line of a server log fails the test,
except the known benign lines of an explicit allow-list.

Keywords: ERROR, CRITICAL, FATAL, Traceback, Exception, panic, Segmentation fault, corrupted, core dumped,
and native libraries' glog error lines (`E1201 15:11:35.73 ...`, e.g. NIXL's). An allow-list entry is one whole line (after the log's timestamp prefix), matched exactly, where `{*}` stands for
one run of non-space characters (a URL, a port, an id). A line that matches an entry but carries another error
keyword in what `{*}` stood for still fails: an allowed line cannot hide an error.
"""

from __future__ import annotations

import re

KEYWORDS = re.compile(r"\bERROR\b|\bCRITICAL\b|\bFATAL\b|\bTraceback\b|\bException\b|\bpanic\b|"
                      r"Segmentation fault|\bcorrupted\b|core dumped|"
                      r"^[EF]\d{4} \d\d:\d\d:\d\d", re.IGNORECASE)      # the last: glog's error / fatal lines
_PREFIX = re.compile(r"^\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:[.,]\d+)?\s*")


def _pattern(entry: str) -> re.Pattern:
    return re.compile("".join(r"(\S+)" if part == "{*}" else re.escape(part)
                              for part in re.split(r"(\{\*\})", entry)))


def offending_lines(text: str, allow: tuple[str, ...] = ()) -> list[str]:
    patterns = [_pattern(a) for a in allow]
    bad = []
    for raw in text.splitlines():
        line = _PREFIX.sub("", raw.rstrip())
        if not KEYWORDS.search(line):
            continue
        allowed = False
        for p in patterns:
            m = p.fullmatch(line)
            if m and not any(KEYWORDS.search(g) for g in m.groups()):
                allowed = True
                break
        if not allowed:
            bad.append(raw)
    return bad


def assert_clean(logs: dict[str, str], allow: tuple[str, ...] = ()) -> None:
    """`logs`: name -> log text. Fails naming every offending line of every log."""
    found = {name: offending_lines(text, allow) for name, text in logs.items()}
    found = {k: v for k, v in found.items() if v}
    assert not found, "error lines in server logs:\n" + "\n".join(f"[{k}] {line}" for k, v in found.items()
                                                                  for line in v)
