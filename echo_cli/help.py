"""`--help` of a command that reads whole at 80 columns.

typer draws a command's options as a rich table whose columns (name, --no-name, type, help) share the
width: at 80 columns the long names of config fields were cut ("--grad-checkpointi…"). Here a command's
help is click's own layout, which puts a name too long for its column on a line of its own and its
help below it, with typer's panels (the TOML table an option belongs to) as sections. Lists of
commands (`echo-rl --help`) keep typer's rich layout: their names are short.
"""

from __future__ import annotations

from typing import Any

import typer
from typer.core import TyperCommand


class WholeHelpCommand(TyperCommand):
    """A typer command whose --help is click's layout, in sections by rich_help_panel (else Arguments and
    Options)."""

    # ctx and formatter are click's (typer vendors its own click: typer._click)
    def format_help(self, ctx: Any, formatter: Any) -> None:
        super(TyperCommand, self).format_help(ctx, formatter)  # click's: usage, text, options (below), epilog

    def format_help_text(self, ctx: Any, formatter: Any) -> None:
        if self.help:  # rich markup escapes read as text
            formatter.write_paragraph()
            with formatter.indentation():
                for k, paragraph in enumerate(_plain(self.help).split("\n\n")):
                    if k:
                        formatter.write_paragraph()
                    formatter.write_text(" ".join(paragraph.split()))

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        """[OPTIONS] then the arguments as users write them (typer 0.29 prints `{target}`)."""
        arguments = [_argument(p) for p in self.get_params(ctx) if p.param_type_name == "argument"]
        return [self.options_metavar, *arguments] if self.options_metavar else arguments

    def format_options(self, ctx: Any, formatter: Any) -> None:
        sections: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None:
                if param.param_type_name == "argument":  # its name as the usage line shows it, not `target <path>`
                    record = (_argument(param), record[1])
                default = "Arguments" if param.param_type_name == "argument" else "Options"
                panel = getattr(param, "rich_help_panel", None) or default
                sections.setdefault(panel, []).append((record[0], _plain(record[1])))
        for title, rows in sections.items():
            with formatter.section(_plain(title)):
                formatter.write_dl(rows)


class EchoTyper(typer.Typer):
    """typer.Typer whose commands get WholeHelpCommand's --help."""

    def command(self, *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("cls", WholeHelpCommand)
        return super().command(*args, **kwargs)


def _plain(text: str) -> str:
    """Help text written for rich markup, as plain text: `\\[run]` is `[run]`."""
    return text.replace("\\[", "[")


def _argument(param: Any) -> str:
    """An argument's name in usage and help: TARGET, RUN_DIRS... (many), [TARGET] (optional)."""
    name = (param.metavar or param.name.upper()) + ("..." if param.nargs != 1 else "")
    return name if param.required else f"[{name}]"
