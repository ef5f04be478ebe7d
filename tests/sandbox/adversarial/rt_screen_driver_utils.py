"""Goes from the allowed triton.runtime.driver.active to the driver's C utilities."""
# expect: static_rejected | triton.runtime.driver.active.utils
# base: yes


def embedding_bag(weight, indices, offsets, *, mode="sum", per_sample_weights=None):
    return triton.runtime.driver.active.utils.load_binary
