"""The ``jaxllm`` command (also ``python -m jaxllm``), with vLLM's subcommands:

    jaxllm serve MODEL [flags]      the OpenAI-compatible server (vLLM's flag names; see `jaxllm.cli.serve`)
    jaxllm chat / complete          talk to a running server, streaming (`jaxllm.cli.chat`)
    jaxllm bench serve [flags]      a running server's latency and throughput, as vLLM's (`jaxllm.cli.bench`)
    jaxllm generate [flags] PROMPT  one-shot generation (`jaxllm.generate`; also the jaxllm-generate script)
    jaxllm plan [flags]             memory and roofline plan of an engine preset on a device (`jaxllm.plan`)

Each subcommand is a module of this package, or an existing entry point it hands its arguments to. Parsing
never imports JAX: a gunicorn master started by ``jaxllm serve`` must not hold a JAX runtime.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import re
import sys
from collections.abc import Callable

# Subcommands that are whole programs of their own: their arguments are handed over as they are.
DELEGATED: dict[str, tuple[str, str]] = {
    "generate": ("jaxllm.generate", "one-shot generation from the command line (--help: its flags)"),
    "plan": ("jaxllm.plan", "memory and decode roofline of an engine preset on a device"),
}
OWN = ["jaxllm.cli.serve", "jaxllm.cli.chat", "jaxllm.cli.bench"]  # each adds its subcommands (add_parsers)


class Parser(argparse.ArgumentParser):
    """argparse, whose error for an unknown flag names the closest known one."""

    def error(self, message: str):
        m = re.match(r"unrecognized arguments: (\S+)", message)
        if m and m.group(1).startswith("-"):
            flag = m.group(1).split("=", 1)[0]
            known = [s for a in self._actions for s in a.option_strings if s.startswith("--")]
            close = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
            if close:
                message += f" (did you mean {close[0]}?)"
        super().error(message)


def build_parser() -> Parser:
    parser = Parser(prog="jaxllm", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"jaxllm {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="{serve,chat,complete,bench,generate,plan}",
                                parser_class=Parser)
    for module in OWN:
        importlib.import_module(module).add_parsers(sub)
    for name, (_, help_text) in DELEGATED.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def _version() -> str:
    from jaxllm import __version__

    return __version__


def _innermost(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the subcommand that was chosen (`jaxllm bench serve`: serve's)."""
    while True:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        chosen = getattr(args, subs[0].dest, None) if subs else None
        if chosen is None:
            return parser
        parser = subs[0].choices[chosen]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in DELEGATED:
        module = importlib.import_module(DELEGATED[argv[0]][0])
        return module.main(argv[1:]) or 0
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if extra:  # the (innermost) subcommand's own error: its usage, and the closest of its flags
        _innermost(parser, args).error(f"unrecognized arguments: {' '.join(extra)}")
    run: Callable[[argparse.Namespace], int] = args.run
    return run(args)
