"""Public ops of the kernel library. Model code calls these; each is a torch custom op (with a
fake implementation, so torch.compile and export trace through it) whose implementation asks
the dispatcher for the best verified kernel of the call's (arch, dtype, shape bucket, graph).
Every op is declared once (search_space.op.Op, beside its problem) and made by
kernels.opdef.define; the attention ops' backwards dispatch their gradient ops (`<op>_grad`)
the same way."""

from __future__ import annotations

from collections.abc import Callable

from kernels.opdef import define, defined, public
from search_space.op import get_op

# The ops model code calls, defined at import so that dispatch knows them (and, through their
# backwards, their gradient ops) before the first call; any other declared op on first use.
embedding_bag = define(get_op("embedding_bag"))
embedding_bag_backward = define(get_op("embedding_bag_backward"))
jagged_attention = define(get_op("jagged_attention"))
gdpa = define(get_op("gdpa"))
target_attention = define(get_op("target_attention"))


def op(name: str) -> Callable:
    """The public function of op `name`: one of this module's, or a plug-in's (declared in a
    module RECFORGE_OPS names; see search_space.problem), defined on first use."""
    if name in defined():
        return public(name)
    return define(get_op(name))


def __getattr__(name: str) -> Callable:
    """`kernels.ops.<name>` for every op declared in search_space/<name>.py (its OP), defined on
    first use: a new op is its own files, with no line here."""
    if name.startswith("_"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        return op(name)
    except ValueError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r} (no op of that name)") from None
