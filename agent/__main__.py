"""`python -m agent` is the `recforge` command (for hosts where the package is not installed)."""

from agent.cli import app

app(prog_name="recforge")
