"""Device-function calls in Triton's interpreter without its repeated set-up.

Interpreted, a launch patches triton.language (its builtins, for the interpreter's semantics) for
the launch's length; each call of a @triton.jit helper from inside the kernel then patches it
again (triton/runtime/interpreter.py, InterpretedFunction.__call__, in Triton 3.9): a scan of
every member of triton.language, its core, tensor and math modules, which finds nothing left to
patch and rebinds a few interpreter helpers to equal copies. On the attention kernels, whose
helpers are called a few times per tile, tests/kernels/test_attention.py took 114 s on one core
with that re-patching and 84 s without.

`install` skips that second patching where it would change nothing: in a call made while a launch
of this thread runs, from a function whose language modules the launch (or an earlier call in it,
whose patches stay) has patched already. Everything else, and every other Triton, goes the
interpreter's own way. The test processes (tests/conftest.py) and the sandbox's runners on a CPU
(sandbox/runner.py, before interpreter_memory wraps the same launch) install it. It changes which
Python runs around a helper call, not what the helper computes or may touch: the memory bounds
check every access of the helper's body as before.
"""

from __future__ import annotations

import threading

_state = threading.local()  # .patched: per running launch, the ids of the modules it has patched
STOCK: dict[str, object] = {}  # the interpreter's own functions, once installed (for the test)


def install() -> None:
    import triton
    import triton.language as tl
    from triton.runtime import interpreter

    grid, device = interpreter.GridExecutor, interpreter.InterpretedFunction
    known = (
        triton.__version__.startswith("3.9.")
        and callable(grid.__dict__.get("__call__"))
        and callable(device.__dict__.get("__call__"))
        and callable(device.__dict__.get("rewrite"))
        and callable(getattr(interpreter, "_patch_lang", None))
    )
    if not known or getattr(device.__call__, "skips_repatching", False):
        return
    languages: dict = {}  # function -> ids of triton.language and its core among its globals

    def languages_of(fn) -> frozenset[int]:
        found = languages.get(fn)
        if found is None:
            found = frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)
            languages[fn] = found
        return found

    patch_lang, launch, call = interpreter._patch_lang, grid.__call__, device.__call__

    def patch_lang_recorded(fn):
        scope = patch_lang(fn)
        stack = getattr(_state, "patched", None)
        if stack:  # patched until the launch ends (a call's patches are never undone)
            stack[-1] |= languages_of(fn)
        return scope

    def launch_tracked(self, *args, **kwargs):
        stack = _state.__dict__.setdefault("patched", [])
        stack.append(set())  # filled by the launch's own _patch_lang, before the kernel runs
        try:
            return launch(self, *args, **kwargs)
        finally:
            stack.pop()

    def call_once_patched(self, *args, **kwargs):
        stack = getattr(_state, "patched", None)
        if not stack:  # outside a launch: the interpreter's own call
            return call(self, *args, **kwargs)
        # The modules as the interpreter's own call finds them: after the rewrite, which gives a
        # function's module the interpreter's globals (triton.language among them) the first time.
        fn = self.rewrite()
        wanted = languages_of(self.fn)
        # (None of them: the interpreter's own call refuses it, and does here.)
        if wanted and wanted <= stack[-1]:
            # The interpreter's own call, less its _patch_lang(self.fn).
            try:
                return fn(*args, **kwargs)
            except Exception as e:
                raise interpreter.InterpreterError(repr(e)) from e
        return call(self, *args, **kwargs)

    call_once_patched.skips_repatching = True
    STOCK.update(_patch_lang=patch_lang, launch=launch, call=call)
    interpreter._patch_lang = patch_lang_recorded  # both its callers look it up at each call
    grid.__call__ = launch_tracked
    device.__call__ = call_once_patched
