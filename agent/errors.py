"""Errors that end a command with one clear line and exit status 2."""

import click


class MmtraceError(click.ClickException):
    """Bad input or an environment that cannot run the command."""

    exit_code = 2

    def show(self, file=None):
        click.echo(f"mmtrace: error: {self.format_message()}", err=True, file=file)
