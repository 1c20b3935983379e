"""triton: two fixes to Triton's CPU interpreter (``TRITON_INTERPRET=1``), held only while
our kernels run in it.

Why no public API serves: the interpreter has no hooks; what it does with a scalar range
bound and with ``tl.dot`` is in private functions of ``triton.runtime.interpreter``:

- ``_patch_lang_tensor`` gives the interpreter's tensors an ``__index__`` that calls
  ``int()`` on the NumPy array (triton 3.6: a 1-element array, which NumPy >= 2.4
  refuses for ``range(lo, hi)`` bounds; triton 3.9 squeezes it first). Ours takes the one
  element, whatever its shape.
- ``InterpreterBuilder.create_dot`` multiplies the raw uint16 bits of bf16 operands
  (3.6 to 3.9); ours widens them to fp32 first.

Compiled kernels are untouched. :func:`interpreter_fixes` installs both on entry and
restores triton's own on the last exit (nested and concurrent launches share one
installation), so no other user of the interpreter in the process sees them.
tests/test_internals.py fails when triton renames either function or fixes the dot.
"""

from __future__ import annotations

import contextlib
import threading

import numpy as np

__all__ = ["interpreter_fixes"]

_LOCK = threading.Lock()
_HELD = {"depth": 0, "saved": None}


def _fixed(it, lang):
    """(triton's own (_patch_lang_tensor, create_dot), our fixed pair)."""
    patch_tensor = it._patch_lang_tensor
    dot = it.InterpreterBuilder.create_dot

    def patched_tensor(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    def widen(h):
        if h.dtype.scalar != lang.bfloat16:
            return h
        bits = (h.data.astype(np.uint32) << 16).view(np.float32)
        return it.TensorHandle(bits, lang.float32)

    def patched_dot(self, a, b, d, *args, **kwargs):
        return dot(self, widen(a), widen(b), d, *args, **kwargs)

    return (patch_tensor, dot), (patched_tensor, patched_dot)


def _install(pair, it) -> None:
    it._patch_lang_tensor, it.InterpreterBuilder.create_dot = pair


@contextlib.contextmanager
def interpreter_fixes():
    """Hold the two fixes while the block runs (kernels launched in it are interpreted
    with them); triton's own functions are back after the outermost block."""
    import triton.language as lang
    from triton.runtime import interpreter as it

    with _LOCK:
        if _HELD["depth"] == 0:
            own, fixed = _fixed(it, lang)
            _HELD["saved"] = own
            _install(fixed, it)
        _HELD["depth"] += 1
    try:
        yield
    finally:
        with _LOCK:
            _HELD["depth"] -= 1
            if _HELD["depth"] == 0:
                _install(_HELD["saved"], it)
                _HELD["saved"] = None
