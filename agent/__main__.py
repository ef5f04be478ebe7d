"""`python -m agent` is the `recforge` command (for hosts where the package is not installed)."""

from agent.entry import main

main()
