"""Reference pages generated from the code, so they cannot drift from it.

The docs site's hook (tools/docs_hooks.py) replaces a marker line such as
``<!-- generated: cli -->`` in a page with what the matching function returns; the
tests (tests/test_docs.py) call the same functions. Each reads the code itself:

- ``cli``: the ``keyscale`` argparse parsers (keyscale.cli.main.build_parser), every
  command and subcommand with its usage and options, and ``ks.main``'s parser;
- ``metrics``: the metric families in keyscale/runtime/control/metrics.py, read from its source
  (every family is created there with a literal name, help text and label list);
- ``exit-codes``: the KeyscaleError classes of keyscale.errors and their exit codes.

Run ``python tools/docs_gen.py cli|metrics|exit-codes`` to print one.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Document this checkout's code, not whichever keyscale the environment has installed.
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell."""
    return text.replace("|", "\\|").replace("\n", " ").strip()


def _help(action: argparse.Action) -> str:
    text = action.help or ""
    if "%(" in text:  # argparse's own interpolation, as --help would show it
        text = text % {**vars(action), "prog": ""}
    return text


def _flags(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.metavar or action.dest}`"
    names = ", ".join(f"`{o}`" for o in action.option_strings)
    if action.nargs == 0:
        return names
    # As argparse's own usage shows it: a choice list, else the metavar, else the dest.
    metavar = action.metavar or ("{" + ",".join(map(str, action.choices)) + "}" if action.choices else action.dest.upper())
    return f"{names} `{metavar}`"


def _default(action: argparse.Action) -> str:
    if not action.option_strings or action.nargs == 0 or action.default in (None, [], argparse.SUPPRESS):
        return ""
    return f"`{action.default}`"


def _parser_markdown(parser: argparse.ArgumentParser, name: str, summary: str, level: int) -> list[str]:
    """One command's section, then one per subcommand (depth first, in the parser's order)."""
    out = [f"{'#' * level} `{name}`", ""]
    if summary:
        out += [summary[0].upper() + summary[1:] + ("" if summary.endswith(".") else "."), ""]
    if parser.description and parser.description != summary:
        out += [parser.description, ""]
    # Wrapped at a fixed width as `--help` would wrap it, whatever the terminal building the site.
    fmt = argparse.HelpFormatter(parser.prog, width=88)
    fmt.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups, prefix="")
    out += ["```text", fmt.format_help().strip("\n"), "```", ""]
    rows = []
    subs: list[tuple[str, argparse.ArgumentParser, str]] = []
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
            continue
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            seen: set[int] = set()
            for sub_name, sub in action.choices.items():
                if id(sub) in seen:  # an alias of a command already listed
                    continue
                seen.add(id(sub))
                subs.append((sub_name, sub, helps.get(sub_name, "")))
            continue
        rows.append(f"| {_flags(action)} | {_cell(_help(action))} | {_default(action)} |")
    if rows:
        out += ["| argument | what | default |", "|---|---|---|", *rows, ""]
    for sub_name, sub, sub_help in subs:
        out += _parser_markdown(sub, f"{name} {sub_name}", sub_help, min(level + 1, 4))
    return out


def cli_markdown() -> str:
    """Every ``keyscale`` command and option, from the parsers the command itself uses."""
    from keyscale.cli.main import build_parser
    from keyscale.runtime.control.submit import _parser as submit_parser

    parser = build_parser()
    lines = _parser_markdown(parser, "keyscale", "", 2)
    lines += ["## A job file's own command line (`ks.main`)", "",
              "A job file that ends with `raise SystemExit(ks.main(build))` takes these arguments "
              "(under `spark-submit` or plain `python`):", ""]
    lines += _parser_markdown(submit_parser("JOBFILE.py"), "JOBFILE.py", "", 3)[2:]
    return "\n".join(lines)


def _literal(node: ast.expr) -> object:
    try:
        return ast.literal_eval(node)
    except ValueError:  # an implicitly concatenated string is a Constant already; anything else is not literal
        return None


def metric_families(source: str | None = None) -> list[tuple[str, str, str, list[str]]]:
    """(name, type, help, labels) of every metric family keyscale/runtime/control/metrics.py creates.

    Read from the source rather than by calling ``families()``: some families are made only
    when the job has a checkpoint, a watermark or a log source, and this lists them all.
    """
    if source is None:
        source = (ROOT / "src/keyscale/runtime/control/metrics.py").read_text()
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
            continue
        kind = {"_gauge": "gauge", "GaugeMetricFamily": "gauge", "CounterMetricFamily": "counter", "HistogramMetricFamily": "histogram"}.get(node.func.id)
        if kind is None or len(node.args) < 2:
            continue
        name, doc = _literal(node.args[0]), _literal(node.args[1])
        labels_node = node.args[2] if len(node.args) > 2 else next((k.value for k in node.keywords if k.arg == "labels"), None)
        labels = _literal(labels_node) if labels_node is not None else []
        if isinstance(name, str) and isinstance(doc, str) and isinstance(labels, list):
            # prometheus-client exposes a counter family as NAME_total.
            found.append((name + ("_total" if kind == "counter" else ""), kind, doc, [str(x) for x in labels]))
    return sorted(found)


def metrics_markdown() -> str:
    rows = ["| metric | type | labels | what |", "|---|---|---|---|"]
    for name, kind, doc, labels in metric_families():
        rows.append(f"| `{name}` | {kind} | {', '.join(f'`{x}`' for x in labels)} | {_cell(doc)} |")
    return "\n".join(rows)


def exit_codes_markdown() -> str:
    import keyscale.errors as errors

    classes = [c for _, c in inspect.getmembers(errors, inspect.isclass)
               if issubclass(c, errors.KeyscaleError) and c.__module__ == errors.__name__]
    rows = ["| exit code | error | when |", "|---|---|---|"]
    for c in sorted(classes, key=lambda c: (c.exit_code, c.__name__)):
        first = _cell(" ".join((inspect.getdoc(c) or "").split("\n\n")[0].split()))
        rows.append(f"| {c.exit_code} | `{c.__name__}` | {first} |")
    return "\n".join(rows)


GENERATORS = {"cli": cli_markdown, "metrics": metrics_markdown, "exit-codes": exit_codes_markdown}


if __name__ == "__main__":
    print(GENERATORS[sys.argv[1]]())
