"""`eagle2-batch models`: the built-in model aliases and whether a draft head ships for each."""

import click

from eagle2_core.registry import ALIASES, DEFAULT_MODEL, shipped_draft


@click.command()
def models() -> None:
    """List built-in model aliases (usable as --model) and their shipped draft heads.

    Any local model directory, .gguf file or (with downloads allowed) Hugging Face id
    works too; these aliases need no download.
    """
    for name, alias in ALIASES.items():
        draft = shipped_draft(name)
        marks = " (default)" if name == DEFAULT_MODEL else ""
        click.echo(f"{name}{marks}\n  {alias.description}")
        click.echo(f"  draft head: {draft if draft else 'none shipped (use --draft DIR)'}")
