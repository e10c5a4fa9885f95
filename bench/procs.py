"""Processes as Linux's /proc shows them: the benchmarks' one reader of parent PIDs, command
lines and CPU time."""

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


def cpu_seconds(pid: int | None = None) -> float:
    """CPU seconds used so far: by the whole machine (every core's non-idle time) when
    ``pid`` is None, else by process ``pid`` (user and system, all its threads)."""
    tick = os.sysconf("SC_CLK_TCK")
    if pid is None:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        return (sum(fields[:8]) - fields[3] - fields[4]) / tick  # all but idle and iowait
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    after = stat[stat.rindex(")") + 2 :].split()  # the name may hold spaces
    return (int(after[11]) + int(after[12])) / tick


def cmdline(pid: int) -> str:
    """``pid``'s command line, "" once it is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
