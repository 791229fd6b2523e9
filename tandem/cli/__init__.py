"""The `tandem` command: one entry that dispatches to the stages; no logic of its own.

Every verb is a file of this package (tandem/cli/<verb>.py: parse, call its stage, render); this file
only registers them and turns a TandemError into one line on stderr and a non-zero exit.
"""

from __future__ import annotations

import sys

import typer
from rich.console import Console
from rich.markup import escape

from tandem.cli.bench import bench_app
from tandem.cli.data import data_app
from tandem.cli.demo import demo_cmd
from tandem.cli.diagnose import diagnose_cmd
from tandem.cli.doctor import doctor_cmd
from tandem.cli.export import export_cmd
from tandem.cli.generate import generate_cmd
from tandem.cli.helpwidth import keep_help_words
from tandem.cli.launch import launch_cmd
from tandem.cli.logs import logs_cmd
from tandem.cli.passthrough import PASSTHROUGH
from tandem.cli.plan import plan_cmd
from tandem.cli.serve import serve_cmd
from tandem.cli.spec import spec_cmd
from tandem.cli.submit import cancel_cmd, status_cmd, submit_cmd
from tandem.cli.train import train_cmd
from tandem.cli.usage import usage_error
from tandem.core.errors import TandemError

app = typer.Typer(
    name="tandem",
    help="From one GPU to many machines and on into serving, with numbers that say why.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        import tandem

        print(f"tandem {tandem.__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(version: bool = typer.Option(False, "--version", "-V", is_eager=True, callback=_version,
                                       help="Print tandem's version and exit.")) -> None:
    """From one GPU to many machines and on into serving, with numbers that say why."""


def _register() -> None:
    app.command("launch", context_settings=PASSTHROUGH)(launch_cmd)
    app.command("train", context_settings=PASSTHROUGH)(train_cmd)
    app.command("spec", context_settings=PASSTHROUGH)(spec_cmd)
    app.command("demo")(demo_cmd)
    app.add_typer(bench_app, name="bench")
    app.command("doctor")(doctor_cmd)
    app.command("plan")(plan_cmd)
    app.command("export")(export_cmd)
    app.command("diagnose")(diagnose_cmd)
    app.command("serve")(serve_cmd)
    app.add_typer(data_app, name="data")
    app.command("generate")(generate_cmd)
    app.command("submit", context_settings=PASSTHROUGH)(submit_cmd)
    app.command("status")(status_cmd)
    app.command("cancel")(cancel_cmd)
    app.command("logs")(logs_cmd)


_register()


def main(argv: list[str] | None = None) -> None:
    err = Console(stderr=True)
    keep_help_words()  # --help piped or in a narrow terminal: no flag name cut to '…'
    try:
        app(args=argv, prog_name="tandem", standalone_mode=False)
    except TandemError as e:
        err.print(f"[bold red]error[/]: {escape(str(e))}", highlight=False, soft_wrap=True)  # keeps tandem[ray], n[1-2]
        sys.exit(e.exit_code)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except typer.Abort:
        err.print("aborted")
        sys.exit(130)
    except Exception as e:
        if _is_usage_error(e):
            line = usage_error(e)
            if line is None:
                e.show()  # a bare group: its help (exit 2)
            else:
                err.print(f"[bold red]error[/]: {escape(str(line))}", highlight=False, soft_wrap=True)
            sys.exit(e.exit_code)
        raise


def _is_usage_error(e: BaseException) -> bool:
    """A click usage error, whichever click raised it.

    typer >= 0.20 carries its own copy of click (``typer._click``) and no longer
    installs ``click``; older typer uses ``click`` itself. Both exception classes
    are named ClickException and have ``show()`` and ``exit_code``, so match on
    that rather than import a module that may be absent.
    """
    return any(c.__name__ == "ClickException" for c in type(e).__mro__) and hasattr(e, "show")


def entry() -> None:
    """The ``tandem`` command: main(), then leave without the interpreter's teardown (fastexit.py)."""
    from tandem.core.fastexit import run_and_exit

    run_and_exit(main)


if __name__ == "__main__":
    entry()
