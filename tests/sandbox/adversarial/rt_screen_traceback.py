"""Reaches a frame through a caught exception (e.with_traceback / tb_frame) to read the
harness's locals."""
# expect: static_rejected | with_traceback
# base: yes


def embedding_bag(weight, indices, offsets, *, mode="sum", per_sample_weights=None):
    try:
        raise RuntimeError("probe")
    except RuntimeError as e:
        return e.with_traceback(None).tb_frame
