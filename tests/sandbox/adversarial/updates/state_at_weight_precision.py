"""Keeps Adagrad's fp32 state only at the weights' precision: for bf16 (or fp16) weights the
new state is rounded to bf16 (fp16) before it is stored. One step is within the tolerance the
judge applies to the state, which is the weights' dtype's (bf16: 1.6e-2 relative) although the
state is an fp32 buffer; over a training run the rounded sum stops growing once a step's g^2 is
below half its unit (about 1/256 of the sum in bf16), so the effective learning rate never
decays.

Refused: each updated argument is compared under its own dtype's tolerance (the state's fp32)."""
# from: template
# expect: wrong | output 1
# timing: no

EDITS = [
    (
        "        tl.store(state_ptr + key_I, total_I, mask=mask_I)",
        "        total_I = total_I.to(weights_ptr.dtype.element_ty).to(tl.float32)\n"
        "        tl.store(state_ptr + key_I, total_I, mask=mask_I)",
    ),
]
