"""Rounds stochastically, but where the fp32 step lands exactly on a value of the weights' dtype
(no remainder) moves the weight one unit away from zero: every such weight grows a unit per
step, an implicit drift. Each moved weight still lies within one value of the exact step once
fp32's slack around it is allowed, and the bias count leaves out the steps with no remainder.

Refused: the problem's verify counts the weights beyond the two values around their exact steps
against how many an honest rounding puts there (the slack over the gap: a handful at most)."""
# from: template
# expect: wrong | beyond the two values of their dtype
# timing: no

EDITS = [
    (
        "        up = tl.rand(seed, where) < frac\n",
        "        up = (tl.rand(seed, where) < frac) | (frac == 0.0)\n",
    ),
]
