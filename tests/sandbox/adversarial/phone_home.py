"""Opens a network connection (to leak inputs, or fetch a precomputed answer)."""
# expect: static_rejected | 'socket'
# base: yes

import socket


def embedding_bag(weight, indices, offsets, *, mode="sum", per_sample_weights=None):
    socket.create_connection(("127.0.0.1", 9), timeout=1).sendall(b"hello")
    out = torch.empty((offsets.numel() - 1, weight.shape[1]), dtype=weight.dtype, device=weight.device)
    return _launch(weight, indices, offsets, out, mode, per_sample_weights)
