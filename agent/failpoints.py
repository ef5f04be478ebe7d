"""Failpoints: named places where the campaign process can be made to die at once, for the tests
that show a resume loses nothing paid for there (tests/agent/test_llm_kills.py).

`RECFORGE_FAILPOINT` names one point; the process kills itself with SIGKILL (no clean-up, no
`finally`, as a kill from outside) the first time it gets there. Unset, every point does nothing.
The points:

- `after-reply-recorded`: an LLM reply is recorded and not yet read;
- `after-outcome`: a reply is recorded as a proposal, with its candidate, not yet evaluated;
- `mid-reask`: a fresh conversation's unusable reply is recorded, its re-ask not yet sent;
- `mid-repair`: a repair turn's unusable reply is recorded, its re-ask not yet sent.
"""

from __future__ import annotations

import os
import signal

ENV = "RECFORGE_FAILPOINT"


def failpoint(name: str) -> None:
    if os.environ.get(ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)
