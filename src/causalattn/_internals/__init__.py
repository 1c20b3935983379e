"""The private names of other libraries that causalattn still needs: one small module per
library, each saying why no public API serves, each pinned by tests/test_internals.py (which
fails when the library changes the name or what it does). Nothing here imports causalattn;
each module imports only its own library (with NumPy and the standard library), and this package
imports none of them: a module that needs one imports it by name.

- :mod:`.typer`: the click exceptions that typer raises (``typer._click``);
- :mod:`.transformers`: a model's current attention implementation
  (``config._attn_implementation``);
- :mod:`.torch`: autograd inside an operator (``torch._C._ForceDispatchKeyGuard``), Dynamo's
  constant mark without importing Dynamo, whether a torch.func transform runs, FakeTensor,
  a tensor's version counter;
- :mod:`.triton`: two fixes to Triton's CPU interpreter, held only while our kernels run.

No private name of another library is left outside this package in ``engines/`` or
``integrations/hf_pattern.py`` (``ThreadPoolExecutor._max_workers`` is gone too:
``engines/tiled_pool.py`` keeps its own count).
"""
