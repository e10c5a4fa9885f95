"""Processes as Linux's /proc shows them: the chaos harness's and its cluster plumbing's one
reader of parent PIDs and command lines."""

from __future__ import annotations

import os


def ppid(pid: int) -> int | None:
    """``pid``'s parent, None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        return int(stat[stat.rindex(")") + 2:].split()[1])  # after the command, which may hold spaces
    except (OSError, ValueError, IndexError):
        return None


def descendants(pid: int) -> list[int]:
    """Processes below ``pid`` (children, grandchildren, ...), by parent PID."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit() and (pp := ppid(int(d))) is not None:
            children.setdefault(pp, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def cmdline(pid: int) -> str:
    """``pid``'s command line, "" once it is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
