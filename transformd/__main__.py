"""``python -m transformd`` runs the command-line interface."""

from .cli import run

run()
