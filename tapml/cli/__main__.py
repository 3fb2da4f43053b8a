"""``python -m tapml.cli``: the same as the ``tapml`` command."""

from tapml.cli import main

main()
