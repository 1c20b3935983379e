"""The private names of other libraries that causalattn still needs: one small module per
library, each saying why no public API serves, each pinned by tests/test_internals.py (which
fails when the library changes the name). Nothing here imports causalattn, or torch.

- :mod:`.typer`: the click exceptions that typer raises (``typer._click``);
- :mod:`.transformers`: a model's current attention implementation
  (``config._attn_implementation``).

Left in ``engines/`` for now (issue 26's closing note): ``torch._C`` dispatch guards in
``engines/ops.py`` and the Triton interpreter fixes in ``engines/triton.py``
(``ThreadPoolExecutor._max_workers`` is gone: ``engines/tiled_pool.py`` keeps its own count).
"""
