"""`tandem data prepare-text SRC... --out DIR`: text files to token files (data/text.py), with a progress bar."""

from __future__ import annotations

from pathlib import Path
from typing import List

import typer

data_app = typer.Typer(help="Prepare data sets for tandem train (docs/data.md).", no_args_is_help=True,
                       add_completion=False)


@data_app.command("prepare-text")
def prepare_text_cmd(
    srcs: List[str] = typer.Argument(..., metavar="SRC...", help="Text files, or folders searched recursively."),
    out: Path = typer.Option(..., "--out", help="Folder to write: train.bin, held_out.bin, manifest.json (and "
                                                "tokenizer.json for bpe or a Hugging Face tokenizer)."),
    glob: List[str] = typer.Option(["*"], "--glob", help="File name patterns to take from folders (repeatable), "
                                                         "e.g. --glob '*.py'. Files that are not UTF-8 are skipped."),
    exclude: List[str] = typer.Option([], "--exclude", help="Leave out files whose relative path, or a folder on "
                                                            "it, matches (repeatable), e.g. --exclude site-packages."),
    tokenizer: str = typer.Option("byte", "--tokenizer", help="byte (vocabulary 256) | bpe (trained on the train "
                                                              "split with the tokenizers library: pip install "
                                                              "'tandem[text]') | DIR: a Hugging Face tokenizer, a "
                                                              "folder holding tokenizer.json (tokenizer_config.json "
                                                              "optional) or the file: a base model's tokens, for a "
                                                              "fine-tune; copied into --out."),
    vocab: int = typer.Option(4096, "--vocab", help="bpe: vocabulary size (a Hugging Face tokenizer has its own)."),
    held_out: float = typer.Option(0.05, "--held-out", help="Fraction of the bytes kept out of training, as whole "
                                                            "files (one file: its tail)."),
    force: bool = typer.Option(False, "--force", help="Replace an existing --out folder."),
) -> None:
    """Tokenize text files into memory-mapped token files with a manifest, for data.name = "tokens"."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn

    from tandem.core.console import make_console
    from tandem.data.text import prepare_text

    console = make_console(stderr=True)
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(), TimeElapsedColumn(),
                  console=console, transient=False) as bar:
        def progress(label: str, total: int):
            task = bar.add_task(label, total=total)
            return lambda n: bar.advance(task, n)

        man = prepare_text(srcs, out, globs=glob, excludes=exclude, tokenizer=tokenizer, vocab=vocab,
                           held_out=held_out, force=force, progress=progress)
    tr, ho = man["splits"]["train"], man["splits"]["held_out"]
    print(f"wrote {out}: {man['tokenizer']['kind']} tokenizer, vocabulary {man['vocab']}, {man['dtype']} tokens")
    for name, s in (("train", tr), ("held-out", ho)):
        print(f"  {name}: {s['files']} files, {s['bytes']:,} bytes, {s['tokens']:,} tokens "
              f"({s['tokens_per_byte']:.3f} per byte), order-0 entropy {s['order0_bits_per_byte']:.3f} bits per byte")
    if man["skipped_not_utf8"]:
        print(f"  skipped {man['skipped_not_utf8']} file(s) that are not UTF-8 text")
