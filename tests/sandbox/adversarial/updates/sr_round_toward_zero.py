"""Ignores `stochastic_rounding`: with the flag set, every updated weight is rounded toward zero
(a biased rounding: an implicit decay of every updated weight by half a unit in the last place
per step) instead of up or down at random. The reference rounds to nearest, and the tolerance
admits any rounding within one unit of it, so nothing checks that the rounding is stochastic or
unbiased.

Refused: the problem's verify counts how often weights round up against their exact steps' fractions."""
# from: template
# expect: wrong | stochastic rounding is biased
# timing: no

EDITS = [
    ("(_bits(seed, where) & 0xFFFF)", "0"),  # bf16: the kept half alone
    ("        return tl.where(u < frac, high, low)\n", "        return low\n"),  # fp16
]
