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

# The state's store is in `_scale`, which is not given the weights: the edits pass their dtype.
EDITS = [
    (
        "def _scale(state_ptr, total_I, grad_sq_I, key_I, dim_I, mask_I, lr, eps, ADAGRAD: tl.constexpr):",
        "def _scale(state_ptr, total_I, grad_sq_I, key_I, dim_I, mask_I, lr, eps, ADAGRAD: tl.constexpr, LOW: tl.constexpr):",
    ),
    (
        "        tl.store(state_ptr + key_I, total_I, mask=mask_I)",
        "        total_I = total_I.to(LOW).to(tl.float32)\n"
        "        tl.store(state_ptr + key_I, total_I, mask=mask_I)",
    ),
    (
        "        grad_sq_I = tl.sum(grad_ID * grad_ID, axis=1)\n"
        "        step_I = _scale(state_ptr, total_I, grad_sq_I, key_I, dim_I, whole_I, lr, eps, ADAGRAD)",
        "        grad_sq_I = tl.sum(grad_ID * grad_ID, axis=1)\n"
        "        step_I = _scale(state_ptr, total_I, grad_sq_I, key_I, dim_I, whole_I, lr, eps, ADAGRAD, "
        "weights_ptr.dtype.element_ty)",
    ),
    (
        "                grad_sq_I += tl.sum(grad_ID * grad_ID, axis=1)\n"
        "        step_I = _scale(state_ptr, total_I, grad_sq_I, key_I, dim_I, whole_I, lr, eps, ADAGRAD)",
        "                grad_sq_I += tl.sum(grad_ID * grad_ID, axis=1)\n"
        "        step_I = _scale(state_ptr, total_I, grad_sq_I, key_I, dim_I, whole_I, lr, eps, ADAGRAD, "
        "weights_ptr.dtype.element_ty)",
    ),
    (
        "keys, dim, keys >= 0, lr, eps, ADAGRAD)",
        "keys, dim, keys >= 0, lr, eps, ADAGRAD, weights_ptr.dtype.element_ty)",
    ),
]
