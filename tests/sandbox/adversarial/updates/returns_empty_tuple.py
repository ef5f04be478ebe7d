"""Returns () instead of None: the runner turns a tuple into its list of outputs, so the judge
sees no outputs, as for None.

Refused: the runner tells None from an empty tuple, and an update must return None."""
# from: template
# expect: wrong | returns None
# timing: no

EDITS = [
    (
        "def embedding_bags_update(",
        "def embedding_bags_update(*args, **kwargs):\n"
        "    _update(*args, **kwargs)\n"
        "    return ()\n\n\n"
        "def _update(",
    ),
]
