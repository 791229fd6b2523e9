"""`tandem generate RUN_DIR|CHECKPOINT|EXPORT --prompt TEXT`: a sample from a trained language model."""

from __future__ import annotations

from typing import Optional

import typer


def generate_cmd(
    source: str = typer.Argument(..., metavar="RUN_DIR|CHECKPOINT|EXPORT",
                                 help="A run dir (its newest checkpoint), a checkpoint folder, or an export folder."),
    prompt: str = typer.Option(..., "--prompt", help="Text to continue."),
    tokens: int = typer.Option(200, "--tokens", help="Tokens to generate."),
    temperature: float = typer.Option(0.8, "--temperature", help="Softmax temperature (0: the most likely token)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the sampler."),
    data: Optional[str] = typer.Option(None, "--data", help="Token folder whose tokenizer to use (default: the "
                                                            "run's data.path)."),
) -> None:
    """Print the prompt and a sample of TOKENS more from a language model trained on data.name = "tokens"."""
    from tandem.serve.generate import generate  # torch inside: `tandem --help` stays fast

    text, loaded = generate(source, prompt, tokens, temperature, seed, data)
    print(f"# {tokens} tokens from {loaded.source}, temperature {temperature:g}, seed {seed}")
    print(prompt + text)
