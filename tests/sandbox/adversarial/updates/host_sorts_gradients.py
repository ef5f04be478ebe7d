"""Host code computing with the problem's allowed extras on floats: the gathered gradients'
segment sums made on the host with torch.sort and torch.cumsum (allowed names for this problem,
meant for the integer keys) on grad_out, before the kernels run. Must not be accepted: the extras
are allowed on integer data only."""
# from: template
# expect: suspicious | on float
# timing: no

EDITS = [
    (
        "    device = indices.device\n",
        "    device = indices.device\n"
        "    running = torch.cumsum(grad_out.float(), 0)\n",
    ),
]
