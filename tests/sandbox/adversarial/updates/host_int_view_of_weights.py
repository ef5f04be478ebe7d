"""Host code on integer views of float data: the weights' bits viewed as int16/int32 (a view,
no copy: bookkeeping) so that host integer ops (here a sort of the bits, an allowed extra of this
problem) run on the data. Must not be accepted: floating-point data viewed as integers is the
data."""
# from: template
# expect: suspicious | viewed as
# timing: no

EDITS = [
    (
        "    device = indices.device\n",
        "    device = indices.device\n"
        "    bits = weights.view(torch.int16 if weights.element_size() == 2 else torch.int32)\n"
        "    ranked, _ = torch.sort(bits)\n",
    ),
]
