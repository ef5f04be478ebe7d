"""Returns the updated weights and state (as an ordinary op returns its outputs) instead of None.
Must fail: an op that updates its arguments in place returns None."""
# from: template
# expect: wrong | shares memory with an input || returns None
# timing: no

EDITS = [
    (
        "def embedding_bags_update(",
        "def embedding_bags_update(*args, **kwargs):\n"
        "    _update(*args, **kwargs)\n"
        "    return args[0], args[1]\n\n\n"
        "def _update(",
    ),
]
