"""``python -m causalattn``: the ``causalattn`` command."""

from .cli import main

main()
