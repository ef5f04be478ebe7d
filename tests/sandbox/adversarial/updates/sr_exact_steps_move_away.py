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
    (  # bf16: a whole unit added where the kept half is the exact value
        "            up = w.to(tl.uint32, bitcast=True) + (_bits(seed, where) & 0xFFFF)\n",
        "            bits = w.to(tl.uint32, bitcast=True)\n"
        "            up = bits + tl.where((bits & 0xFFFF) == 0, 0x10000, _bits(seed, where) & 0xFFFF)\n",
    ),
    (  # fp16
        "        return tl.where(u < frac, high, low)\n",
        "        return tl.where((u < frac) | (frac == 0.0), high, low)\n",
    ),
]
