"""``python -m causalattn.cli``: the ``causalattn`` command."""

from . import main

main()
