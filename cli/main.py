"""The `kiln` command: one entry point, a subcommand per job.

Each subcommand's module is imported only when it runs, so `kiln serve` never
pulls in torch and `kiln --help` is instant. Errors a user can fix print one
line and exit 1; argparse's usage errors exit 2.
"""

from __future__ import annotations

import argparse
import sys

from kiln.runtime.errors import KilnError

from . import export_commands, generate_command, serve_command


class OneLineParser(argparse.ArgumentParser):
    """Usage errors as one line: what was wrong and where to look, no usage dump."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="kiln", description="Ahead-of-time compiled LLM serving on IREE.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True
    export_commands.add_commands(commands)
    generate_command.add_command(commands)
    serve_command.add_command(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    extra_flags = []
    if "--" in argv:  # what follows goes to iree-compile untouched
        at = argv.index("--")
        argv, extra_flags = argv[:at], argv[at + 1 :]
    args = parser.parse_args(argv)
    if extra_flags:
        if not hasattr(args, "extra_flags"):
            parser.error(f"'-- FLAGS' is only for compile-vmfb and build, not {args.command}")
        args.extra_flags = extra_flags
    try:
        return args.run(args) or 0
    except KeyboardInterrupt:
        print("kiln: interrupted", file=sys.stderr)
        return 130
    except KilnError as error:  # a user's mistake or a model Kiln cannot run: one line, no traceback
        print(f"kiln: error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
